"""How rows and requests cross between the caller and vLLM's processes: the keys a request carries
(:mod:`.keys`), the row channels (:mod:`.channels`), rows left in this process (:mod:`.mailbox`) and the
shared-memory slot file (:mod:`.shm`). Imports no vLLM; both sides import it."""
