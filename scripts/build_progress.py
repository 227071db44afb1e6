"""Progress of a source build that ``pip install -v`` runs, a line at least every 30 s.

``pip install -v ... 2>&1 | python scripts/build_progress.py LABEL`` reads pip's verbose output and prints:

- pip's own lines that say what it fetches and installs (``Using cached``, a download of 1 MB or more,
  ``Successfully installed``, errors and warnings), except those of its install of the build's own tools
  (scikit-build-core, ...) into the build's isolated environment;
- the build backend's phase lines (scikit-build-core's ``*** Configuring CMake...``, ``*** Building project
  with Ninja...``, ...);
- the compile steps, ninja's ``[n/m] ...`` lines (n of m steps finished; in a pipe ninja prints a step when it
  finishes), at most one per ``STEP_EVERY`` seconds, as ``LABEL: n/m steps done, newest: FILE`` (and the last
  one before the build's next phase or pip's next line);
- while nothing else is printed, a heartbeat every ``HEARTBEAT`` seconds with the time so far and the newest
  step, so that a silent compile of one large file still shows the build is alive.

Everything else (compiler command lines, CMake's checks) is dropped; bootstrap.sh keeps pip's whole output in a
log that it prints if pip fails. Every line starts with the time since this filter started.
"""

from __future__ import annotations

import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

STEP_EVERY = 10.0  # seconds: the most often a compile step is printed
HEARTBEAT = 25.0  # seconds: the longest the filter stays silent while the build runs (the promise is 30 s)

_NINJA = re.compile(r"^\[(\d+)/(\d+)\]\s+(.*)$")
_PHASE = re.compile(r"^\*\*\* (.+)$")
_PIP = re.compile(
    r"^\s*(Using cached \S+\.whl"
    r"|Downloading .*\([0-9.]+ (MB|GB)\)$"
    r"|Successfully installed .*"
    r"|Building wheel for \S+"
    r"|Created wheel for \S+"
    r"|(ERROR|WARNING)(?!: Location).*)"
)
# pip's own install of the build's tools (scikit-build-core, ...) into an isolated environment: not what we install
_TOOLS_START = re.compile(r"^\s*Installing build dependencies: started")
_TOOLS_END = re.compile(r"^\s*Installing build dependencies: finished")
_SOURCE = re.compile(r"(?:^|\s)-c\s+(\S+)")  # a compiler command line's source file
_OUTPUT = re.compile(r"(?:^|\s)-o\s+(\S+)")  # a compiler or linker command line's output


def step_name(command: str) -> str:
    """A short name for one ninja step: the source file a compile reads, the file a link writes, or ninja's
    own description's last word (``Building CXX object DIR/FILE.o``) when it is not verbose; the last two parts of
    the path."""
    for pattern in (_SOURCE, _OUTPUT):
        found = pattern.search(command)
        if found:
            return "/".join(found.group(1).split("/")[-2:])
    words = command.split()
    return "/".join(words[-1].split("/")[-2:]) if words else command


def clock(seconds: float) -> str:
    """``95.2`` → ``1 min 35 s``."""
    whole = int(seconds)
    return f"{whole // 60} min {whole % 60:02d} s" if whole >= 60 else f"{whole} s"


@dataclass
class Progress:
    """What to print for each line of a build's output and at each tick of the clock (seconds since start)."""

    label: str
    step_every: float = STEP_EVERY
    heartbeat: float = HEARTBEAT
    last_printed: float = 0.0
    step: tuple[int, int, str] | None = None  # the newest ninja step: (finished, total, name)
    step_shown: bool = True
    tools: bool = False  # inside pip's install of the build's tools
    lines: list[str] = field(default_factory=list)

    def _say(self, now: float, text: str) -> None:
        self.lines.append(f"      [{clock(now):>10}] {text}")
        self.last_printed = now

    def _show_step(self, now: float) -> None:
        assert self.step is not None
        done, total, name = self.step
        self._say(now, f"{self.label}: {done}/{total} steps done, newest: {name}")
        self.step_shown = True

    def feed(self, line: str, now: float) -> list[str]:
        """The lines to print for one line of output read at ``now``."""
        line = line.rstrip("\n")
        stripped = line.strip()
        ninja = _NINJA.match(stripped)
        if _TOOLS_START.match(line) or _TOOLS_END.match(line):
            self.tools = bool(_TOOLS_START.match(line))
        elif self.tools:
            if stripped.startswith("ERROR"):
                self._say(now, stripped)
        elif ninja:
            self.step = (int(ninja.group(1)), int(ninja.group(2)), step_name(ninja.group(3)))
            self.step_shown = False
            if now - self.last_printed >= self.step_every:
                self._show_step(now)
        else:
            phase = _PHASE.match(stripped)
            if phase or _PIP.match(line):
                if not self.step_shown:  # the build's last step before what comes after it
                    self._show_step(now)
                self._say(now, f"{self.label}: {phase.group(1)}" if phase else stripped)
        return self.take()

    def tick(self, now: float) -> list[str]:
        """The lines to print when no output came: the newest step once it is due, or a heartbeat."""
        if not self.step_shown and now - self.last_printed >= self.step_every:
            self._show_step(now)
        elif now - self.last_printed >= self.heartbeat:
            done = f", {self.step[0]}/{self.step[1]} steps done, newest: {self.step[2]}" if self.step else ""
            self._say(now, f"{self.label}: still building{done}")
        return self.take()

    def take(self) -> list[str]:
        out, self.lines = self.lines, []
        return out


def run(
    stream: Iterable[str], label: str, write: Callable[[str], None], now: Callable[[], float] = time.monotonic
) -> None:
    """Filters ``stream`` (read in a thread, so that heartbeats come while it is silent) through ``Progress``."""
    start = now()
    progress = Progress(label)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            out = progress.tick(now() - start)
        else:
            if line is None:
                return
            out = progress.feed(line, now() - start)
        for text in out:
            write(text)


def main(argv: list[str]) -> int:
    label = argv[1] if len(argv) > 1 else "build"

    def write(text: str) -> None:
        print(text, flush=True)

    run(sys.stdin, label, write)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
