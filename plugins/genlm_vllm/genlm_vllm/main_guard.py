"""Refuse, with the fix named, a script that would re-run itself in every process an engine spawns."""

from __future__ import annotations

import ast
import inspect
import os
import sys


def _inside_main_guard(tree: ast.Module, line: int) -> bool:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators)
            and node.body[0].lineno <= line <= (node.body[-1].end_lineno or line)
        ):
            return True
    return False


def check_main_guard() -> None:
    """Refuse to start processes from a script's top level outside ``if __name__ == "__main__":``.

    Spawned processes import the caller's script again; without the guard each of them would start
    an engine of its own, and vLLM fails deep inside with an unrelated message.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or not os.path.exists(path):
        return  # interactive sessions, notebooks, -c: nothing is re-imported
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            break
        frame = frame.f_back
    if frame is None:
        return
    line = frame.f_lineno
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    if not _inside_main_guard(tree, line):
        raise RuntimeError(
            f"{path}, line {line}: this engine starts worker processes, which re-import your script "
            "(vLLM spawns them). Put the code that starts the model under\n"
            '    if __name__ == "__main__":\n'
            "or use the in-process engine (multiprocess=False, no tensor/pipeline parallelism)."
        )
