"""How rows and requests cross between the caller and vLLM's processes: the keys a request carries
(:mod:`.keys`), the row channels (:mod:`.channels`), rows written in this process (:mod:`.mailbox`:
an in-process call's inbox, or by tag) and the shared-memory slot file (:mod:`.shm`). Imports no
vLLM; both sides import it."""
