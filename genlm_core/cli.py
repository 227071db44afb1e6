"""The ``genlm`` command: list backends and their options, print next-token distributions."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from pydantic import BaseModel

from genlm_core.config import nested_model
from genlm_core.errors import GenlmError
from genlm_core.plugins import get_plugins

log = logging.getLogger("genlm")

#: The help of ``-o``.
OPTION_HELP = (
    "backend option (repeatable; `genlm options BACKEND` lists them); a field of a nested option is "
    "KEY.FIELD=VALUE, e.g. live.lookback=2; values are parsed as JSON when they can be"
)

#: Exceptions that mean the user asked for something that cannot be done: one line, exit status 2.
USER_ERRORS = (GenlmError, ValueError, TypeError, LookupError, OSError, ImportError)


class UsageError(GenlmError):
    """A command-line argument is invalid."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (with where to get help) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _number(kind: Callable[[str], Any], minimum: float | None = None, below: float | None = None) -> Any:
    """An argparse type: ``kind`` parsed, then checked against ``minimum`` and ``below``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if value != value or (minimum is not None and value < minimum) or (below is not None and not value < below):
            bounds = [f">= {minimum}"] if minimum is not None else []
            bounds += [f"< {below}"] if below is not None else []
            raise argparse.ArgumentTypeError(f"must be {' and '.join(bounds)}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _text_bytes(text: str) -> bytes:
    """The bytes of a command-line argument as given (invalid UTF-8 survives as its raw bytes)."""
    return os.fsencode(text)


def _text_str(text: str) -> str:
    """A command-line argument as text for a tokenizer; invalid UTF-8 is a usage error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"TEXT is not valid UTF-8: {_text_bytes(text)!r}") from None
    return text


def not_shown_elsewhere(record: logging.LogRecord) -> bool:
    """A root-handler filter: False for records that a handler of their own library already printed
    (huggingface_hub and transformers attach one), so every warning is printed once."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None and logger is not logging.root:
        if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):  # a NullHandler prints nothing
            return False
        if not logger.propagate:
            break
        logger = logger.parent
    return True


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width text table."""
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _version(distribution: str | None) -> str:
    if not distribution:
        return "-"
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "-"


#: What ``genlm backends`` says under the table when it did not import the engines.
NOT_CHECKED = (
    "installed: its modules are there and its plugin's own check passed; it was not imported, so whether it\n"
    "imports and runs here, and what it can do on this machine (CUDA, modes), is not checked:\n"
    "`genlm backends --check` imports each engine."
)


def _runs_here(spec: Any, load: Callable[[str], Any] | None) -> str:
    """The "runs here" cell of a component: its plugin's own check (cheap, import-free), then, with
    ``load`` (``--check``), whether its factory, and the engine with it, imports."""
    reason = spec.unavailable_reason()
    if reason is not None:
        return f"no: {reason}"
    if load is None:
        return "installed"
    try:
        load(spec.name)
    except GenlmError as exc:  # the factory does not import: recorded as a failure of its plugin (below)
        cause = exc.__cause__ or exc
        error = f"{type(cause).__name__}: {' '.join(str(cause).split())}"
        return f"no: its engine does not import ({error}); {spec.repair_hint()}"
    return "yes"


def cmd_backends(args: argparse.Namespace) -> int:
    """The installed backends and trie engines, from the plugins' registrations and the distributions'
    metadata, without importing an engine; ``--check`` also imports each one and asks what it can do here."""
    plugins = get_plugins()
    rows = []
    kinds = (
        ("backend", plugins.backends(), plugins.load_backend),
        ("trie engine", plugins.trie_engines(), plugins.load_trie_engine),
    )
    for kind, specs, load in kinds:
        for name, spec in sorted(specs.items()):
            rows.append(
                [
                    name,
                    kind,
                    spec.distribution or spec.plugin,
                    _version(spec.distribution),
                    _runs_here(spec, load if args.check else None),
                    spec.description,
                ]
            )
    print(table(["name", "kind", "distribution", "version", "runs here", "description"], rows))
    if args.check:
        for name, spec in sorted(plugins.backends().items()):
            details = spec.details_here()
            if details:
                print(f"\n{name} on this machine: {details}")
    elif any(row[4] == "installed" for row in rows):
        print(f"\n{NOT_CHECKED}")
    if plugins.failures:
        print("\nplugins that failed to load:")
        print(
            table(
                ["plugin", "distribution", "error"],
                [[f.plugin, f.distribution or "-", f.error] for f in plugins.failures],
            )
        )
    return 0


def _option_rows(model: type[BaseModel], prefix: str = "") -> list[list[str]]:
    """One row per option of ``model``, and one per field of a nested options model (``live.lookback``)."""
    rows = []
    for name, field in model.model_fields.items():
        annotation = getattr(field.annotation, "__name__", None) or str(field.annotation).replace("typing.", "")
        nested = nested_model(model, [name])
        default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
        if nested is not None:
            default = "(below)"
        rows.append([prefix + name, annotation, default, field.description or ""])
        if nested is not None:
            rows += _option_rows(nested, f"{prefix}{name}.")
    return rows


def cmd_options(args: argparse.Namespace) -> int:
    spec = get_plugins().backend(args.backend)
    print(f"options of backend {spec.name!r} ({spec.options.__name__}):")
    print(table(["option", "type", "default", "description"], _option_rows(spec.options)))
    return 0


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"option {text!r} must look like key=value")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def _options(pairs: Sequence[tuple[str, Any]] | None) -> dict[str, Any]:
    """The ``-o KEY=VALUE`` options as a dict (dotted keys are nested by the backend's options model);
    a key given twice is a usage error."""
    options: dict[str, Any] = {}
    for key, value in pairs or []:
        if key in options:
            raise UsageError(f"option {key!r} is given twice ({options[key]!r} and {value!r})")
        options[key] = value
    return options


def cmd_logprobs(args: argparse.Namespace) -> int:
    from genlm_core.loading import load_model_by_name

    text = _text_str(args.text)
    lm = load_model_by_name(args.model, args.backend, _options(args.option))
    with lm:
        ids = list(lm.tokenizer.encode(text, add_special_tokens=not args.no_special_tokens))
        if not ids:
            raise UsageError("TEXT gives no tokens (and the tokenizer adds none): give some text")
        logprobs = lm.next_token_logprobs_sync(ids)
        top = logprobs.topk(min(args.top, logprobs.numel()))
        rows = [
            [rank + 1, i, repr(bytes(lm.byte_vocab[i])), f"{lp:.4f}", f"{pow(2.718281828459045, lp):.4f}"]
            for rank, (lp, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()))
        ]
    print(f"context: {len(ids)} tokens; top {len(rows)} next tokens")
    print(table(["rank", "id", "bytes", "logprob", "prob"], rows))
    return 0


def cmd_continue(args: argparse.Namespace) -> int:
    import asyncio

    from genlm_core.loading import load_model_by_name

    text = _text_bytes(args.text)
    lm = load_model_by_name(args.model, args.backend, _options(args.option))  # a wrong name fails before torch
    from genlm_core.bytes import BeamParams, ByteBeamState

    async def run() -> bytes:
        beam = await ByteBeamState.initial(lm, BeamParams(K=args.beam, prune_threshold=args.prune))
        try:
            if args.sample:
                return await beam.sample(text, args.bytes, seed=args.seed)
            return await beam.greedy(text, args.bytes)
        finally:
            beam.cleanup()

    with lm:
        out = asyncio.run(run())
    print(out.decode("utf-8", errors="replace"))
    return 0


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="genlm", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO)")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "backends",
        help="installed backends and trie engines, and plugins that failed (imports no engine; --check does)",
    )
    b.add_argument(
        "--check",
        action="store_true",
        help="also import each backend and trie engine: whether it runs here, and what it can do on this machine",
    )
    b.set_defaults(func=cmd_backends)
    o = sub.add_parser("options", help="the options a backend accepts")
    o.add_argument("backend")
    o.set_defaults(func=cmd_options)
    lp = sub.add_parser("logprobs", help="top next tokens after TEXT")
    lp.add_argument("model", help="model name or path, as the backend understands it")
    lp.add_argument("text")
    lp.add_argument("--backend", "-b", default=None, help="backend name (default: the default backend)")
    lp.add_argument(
        "--top", "-k", type=_number(int, 1), default=10, help="how many tokens to show (at most the vocabulary)"
    )
    lp.add_argument(
        "--option",
        "-o",
        action="append",
        type=_parse_option,
        metavar="KEY=VALUE",
        help=OPTION_HELP,
    )
    lp.add_argument("--no-special-tokens", action="store_true", help="do not add BOS/special tokens to the text")
    lp.set_defaults(func=cmd_logprobs)
    c = sub.add_parser("continue", help="continue TEXT byte by byte with the byte-level beam (greedy by default)")
    c.add_argument("model", help="model name or path ('smollm2': the offline default model)")
    c.add_argument("text")
    c.add_argument("--backend", "-b", default=None, help="backend name (default: the default backend)")
    c.add_argument("--bytes", "-n", type=_number(int, 0), default=40, help="how many bytes to add (>= 0)")
    c.add_argument("--beam", "-K", type=_number(int, 1), default=5, help="beam width (>= 1)")
    c.add_argument(
        "--prune", type=_number(float, 0.0, 1.0), default=0.0, help="prune hypotheses below this share of the mass"
    )
    c.add_argument("--sample", action="store_true", help="sample instead of greedy")
    c.add_argument("--seed", type=_number(int, 0), default=None, help="random seed for --sample (>= 0)")
    c.add_argument("--option", "-o", action="append", type=_parse_option, metavar="KEY=VALUE", help=OPTION_HELP)
    c.set_defaults(func=cmd_continue)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; user errors print one line on stderr and return 2 (``-v`` adds the traceback)."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:  # usage errors (already printed, one line) and --help
        return exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("genlm_core.assets").setLevel(logging.INFO)  # announce one-time downloads and builds
    handlers = list(logging.root.handlers)
    for handler in handlers:
        handler.addFilter(not_shown_elsewhere)
    logging.captureWarnings(True)  # a library's warnings.warn is printed once, through logging
    try:
        return run(args)
    finally:
        logging.captureWarnings(False)
        for handler in handlers:
            handler.removeFilter(not_shown_elsewhere)


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; a user error is one line on stderr and exit status 2."""
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("genlm: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        user_error = isinstance(exc, USER_ERRORS)
        log.debug("traceback", exc_info=exc)
        message = " ".join(str(exc).split()) or type(exc).__name__
        if not isinstance(exc, GenlmError):
            message = f"{type(exc).__name__}: {message}"
        hint = "" if user_error or args.verbose else " (an internal error; rerun with -v for the traceback)"
        print(f"genlm: error: {message}{hint}", file=sys.stderr)
        return 2 if user_error else 1


if __name__ == "__main__":
    sys.exit(main())
