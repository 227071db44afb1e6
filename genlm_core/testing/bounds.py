"""Tolerances derived from floating-point error bounds, for tests that compare rows of log-probabilities.

A tolerance in a test of rows says where it comes from: a tolerance just above what one machine measured
fails on another machine, thread count or batch split. Each function here returns a :class:`Bound` (a
float that carries its derivation in ``basis``) and states its derivation in its docstring. A check then
asserts through :func:`within`, which also records ``(check, tolerance, difference)`` when the environment
variable ``GENLM_RECORD_BOUNDS`` names a file (one JSON object a line, appended), so that a run can report
the margin of every check::

    from genlm_core.testing import bounds

    tol = bounds.log_softmax_difference(len(row))
    bounds.within("batched vs single", (row - other).abs().max().item(), tol)

Notation: ``u`` is the unit roundoff (:data:`U32` for float32, :data:`U64` for float64): every basic
operation ``fl(a op b) = (a op b)(1 + d)`` with ``|d| <= u``.

Two kinds of bound appear:

- **worst case** (:func:`gamma`): Higham's ``gamma_n = n u / (1 - n u)``; a sum of ``n`` terms in any order
  is off by at most ``gamma_{n-1} * sum |x_i|``. Sound for every input and order, but loose for large ``n``:
  for a vocabulary of 50,257 terms it is 3e-3 relative, where real errors are about 1e-7.
- **probabilistic** (:func:`gamma_probabilistic`): Higham & Mary, "A new approach to probabilistic rounding
  error analysis" (SIAM J. Sci. Comput. 41(5), 2019), Theorem 2.4: if the rounding errors are
  mean-independent with mean zero, a sum of ``n`` terms in any order is off by at most
  ``gamma~_{n-1}(lam) * sum |x_i|`` with ``gamma~_n(lam) = exp(lam sqrt(n) u + n u^2 / (1 - u)) - 1``
  (about ``lam sqrt(n) u``), with probability at least ``1 - 2n exp(-lam^2 (1 - u)^2 / 2)``. With
  :data:`LAMBDA` = 8 a sum of 50,257 terms fails it with probability below 1.3e-9, per sum. This is what the
  row checks use: it holds for any order (so for any thread count and any split into vector lanes or
  blocks) and is a thousand times tighter than the worst case at ``n = 5e4``.

Whole-model comparisons (two backends, or one backend under two batch splits) change the accumulation order
of every matrix product in every layer; no useful analytic bound follows from the logits' magnitudes
alone. For those, :func:`float32_error` measures the float32 forward pass's own rounding error against a
float64 run of the same weights on the same contexts, and :func:`model_difference` bounds the difference
between two float32 computations by a stated multiple of it (see there).
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

#: float32 unit roundoff (round to nearest): 2**-24.
U32 = 2.0**-24
#: float64 unit roundoff (round to nearest): 2**-53.
U64 = 2.0**-53
#: bfloat16 unit roundoff (8 significant bits, round to nearest): 2**-8.
U_BF16 = 2.0**-8
#: float16 unit roundoff (11 significant bits, round to nearest): 2**-11.
U16 = 2.0**-11
#: The probabilistic bounds' ``lam``: a sum of ``n`` terms breaks its bound with probability at most
#: ``2 n exp(-lam^2 / 2)`` = ``2.5e-14 n`` (1.3e-9 for n = 50,257), per sum.
LAMBDA = 8.0
#: Accuracy of a float32 ``exp`` or ``log`` as a relative error, in units of ``u``: 8 u is 4 ulps where an
#: ulp is ``2u`` relative. glibc's ``expf``/``logf`` are correctly rounded or within 1 ulp, SLEEF's u10
#: variants (used by PyTorch's vectorised CPU kernels) within 1 ulp, CUDA's ``expf`` within 2 ulps; 4 ulps
#: covers them all with room.
FN_ULPS_U = 8.0
#: The multiple of a float32 forward pass's measured rounding error (against float64) that bounds the
#: difference between two float32 computations of the same rows: see :func:`model_difference`.
MODEL_FACTOR = 4.0
#: The environment variable naming a file that :func:`within` appends its records to.
RECORD_ENV = "GENLM_RECORD_BOUNDS"

_record_lock = threading.Lock()


class Bound(float):
    """A tolerance: a float that also carries ``basis``, a line saying where its value comes from."""

    basis: str

    def __new__(cls, value: float, basis: str) -> Bound:
        self = super().__new__(cls, value)
        self.basis = basis
        return self

    def __repr__(self) -> str:
        return f"Bound({float(self):.3g}: {self.basis})"


def exact(basis: str = "exact: the same computation on the same bits") -> Bound:
    """A tolerance of 0, for comparisons of identical computations (say why in ``basis``)."""
    return Bound(0.0, basis)


def gamma(n: int, u: float = U32) -> float:
    """Higham's worst-case constant ``gamma_n = n u / (1 - n u)``: ``n`` roundings with ``|d_k| <= u``
    multiply a value by at most ``1 + gamma_n`` (Higham, *Accuracy and Stability of Numerical Algorithms*,
    2nd ed., Lemma 3.1). Requires ``n u < 1``."""
    if n < 0:
        raise ValueError(f"n = {n} < 0")
    if n * u >= 1:
        raise ValueError(f"n u = {n * u} >= 1: no bound")
    return n * u / (1 - n * u)


def gamma_probabilistic(n: int, u: float = U32, lam: float = LAMBDA) -> float:
    """Higham & Mary's probabilistic constant ``gamma~_n(lam) = exp(lam sqrt(n) u + n u^2 / (1 - u)) - 1``
    (about ``lam sqrt(n) u``): ``n`` roundings whose errors are mean-independent with mean zero multiply a
    value by at most ``1 + gamma~_n(lam)`` with probability at least ``1 - 2n exp(-lam^2 (1 - u)^2 / 2)``
    (Higham & Mary 2019, Theorem 2.4). Never larger than :func:`gamma` is useful: take the smaller."""
    if n < 0:
        raise ValueError(f"n = {n} < 0")
    return math.expm1(lam * math.sqrt(n) * u + n * u * u / (1 - u))


def sum_error(n: int, abs_sum: float, u: float = U32, probabilistic: bool = True, lam: float = LAMBDA) -> Bound:
    """Bound on ``|computed - exact|`` of a sum (or dot product, with ``abs_sum = sum |a_i b_i|``) of ``n``
    terms, accumulated in any order at unit roundoff ``u``: ``c_{n-1} * abs_sum`` where ``c`` is
    :func:`gamma_probabilistic` (default; see the module's note) or :func:`gamma` (``probabilistic=False``,
    sound for every input). A sum of ``n`` terms has ``n - 1`` additions, and a product term adds one
    rounding, which the ``n`` (not ``n - 1``) of a dot product's :func:`gamma` covers: pass ``n + 1``."""
    k = max(n - 1, 0)
    if probabilistic:
        c = min(gamma_probabilistic(k, u, lam), gamma(k, u) if k * u < 1 else math.inf)
        how = f"Higham-Mary lam={lam:g}: ~{lam:g} sqrt({k}) u"
    else:
        c, how = gamma(k, u), f"worst case gamma_{k}"
    return Bound(c * abs_sum, f"sum of {n} terms in any order, {how} x sum|x| ({abs_sum:.3g})")


def log_softmax_error(
    vocab: int, logprob: float = 0.0, u: float = U32, probabilistic: bool = True, lam: float = LAMBDA
) -> Bound:
    """Bound on ``|computed - exact|`` of one entry of a ``log_softmax`` over ``vocab`` logits, computed at
    unit roundoff ``u`` from logits ``x`` taken as exact, for an entry whose log-probability is ``logprob``.

    Derivation. The computation is ``d_j = fl(x_j - m)`` with ``m = max x`` (exact), ``e_j = fl(exp(d_j))``,
    ``S = fl(sum e_j)`` in any order, ``L = fl(log S)``, ``l_i = fl(d_i - L)``. Write ``p_j = e_j / S`` and
    ``c = FN_ULPS_U`` (the accuracy of ``exp`` and ``log``).

    - ``d_j`` is off by at most ``u |d_j|``, so ``e_j`` is off relatively by at most ``u |d_j| + c u``.
    - The relative error these give ``S`` is ``sum_j p_j (u |d_j| + c u) <= u (log V + c)``: since
      ``|d_j| = -log e_j = -log p_j - log S`` and ``S >= 1`` (the max's term is 1),
      ``sum_j p_j |d_j| = H(p) - log S <= H(p) <= log V``.
    - Summing ``V`` nonnegative terms in any order adds a relative error ``s_V`` of :func:`sum_error` with
      ``abs_sum = S`` (probabilistic by default: ``~ lam sqrt(V) u``; the dominant term for large ``V``).
    - ``log`` turns a relative error ``r`` of ``S`` into an absolute one ``<= r / (1 - r)``, and adds its
      own ``c u |log S| <= c u log V`` (``1 <= S <= V``).
    - ``l_i = d_i - L`` carries ``d_i``'s ``u |d_i| <= u (|l_i| + log V)`` and adds ``u |l_i|``.

    Total: ``u (2 |l| + (2 + c) log V + c) + s_V``, divided by ``1 - r`` for the second-order terms.
    It holds for any summation order, so for any thread count, vector width and batch split. It does not
    cover ``log(softmax(x))`` computed as a log of a rounded probability (whose error grows as ``p``
    shrinks), nor logits that are themselves computed differently: see :func:`model_difference`.
    """
    if vocab < 1:
        raise ValueError(f"vocab = {vocab} < 1")
    c, log_v = FN_ULPS_U, math.log(vocab)
    s = float(sum_error(vocab, 1.0, u, probabilistic, lam))
    r = u * (log_v + c) + s
    if r >= 0.5:
        raise ValueError(f"relative error {r} of the sum is too large for a bound")
    value = (u * (2 * abs(logprob) + (2 + c) * log_v + c) + s) / (1 - r)
    how = f"Higham-Mary lam={lam:g}" if probabilistic else "worst case"
    return Bound(value, f"log_softmax over V={vocab} at |logprob| <= {abs(logprob):.3g}, u={u:.3g} ({how})")


def log_softmax_difference(
    vocab: int, logprob: float = 0.0, u: float = U32, probabilistic: bool = True, lam: float = LAMBDA
) -> Bound:
    """Bound on the difference between two ``log_softmax`` computations of the same logits (any summation
    orders, any kernels within :data:`FN_ULPS_U`), at entries with ``|log-probability| <= |logprob|``:
    twice :func:`log_softmax_error`, by the triangle inequality through the exact value. ``logprob = 0``
    covers the entries that matter most; pass the most negative log-probability compared to cover all."""
    one = log_softmax_error(vocab, logprob, u, probabilistic, lam)
    return Bound(2 * float(one), f"2 x {one.basis} (two computations, triangle inequality)")


def normalisation_error(vocab: int, u: float = U32, probabilistic: bool = True, lam: float = LAMBDA) -> Bound:
    """Bound on ``|logsumexp(row)|`` (computed in float64) of a float32 ``log_softmax`` row over ``vocab``
    entries. With entry errors ``eps_i``, ``logsumexp(l + eps) = log sum_i p_i exp(eps_i)`` lies between
    ``min eps`` and ``max eps`` and is about ``sum_i p_i eps_i``; :func:`log_softmax_error`'s ``2 u |l_i|``
    term averages to ``2 u H(p) <= 2 u log V`` under ``p``, so the bound is :func:`log_softmax_error` at
    ``|logprob| = log V``, plus the float32 store of each entry (``u |l_i|``, again ``<= u log V`` on
    average), plus the float64 logsumexp's own error (``gamma_{V+2}`` in float64: below 1e-11)."""
    log_v = math.log(vocab)
    one = float(log_softmax_error(vocab, log_v, u, probabilistic, lam))
    value = one + u * log_v + gamma(vocab + 2, U64) * (1 + log_v)
    return Bound(value, f"normalisation of a log_softmax over V={vocab}, u={u:.3g}")


def model_difference(measured: float, factor: float = MODEL_FACTOR, what: str = "") -> Bound:
    """Bound on the difference between two float32 computations of the same model's rows (two backends, or
    one backend under two batch splits or thread counts), from ``measured``: the largest difference
    between a float32 run and a float64 run of the same weights on the same contexts
    (:func:`float32_error`).

    Derivation. Let ``a`` and ``b`` be the two float32 computations and ``r`` the exact rows (float64 is
    exact here to ``~1e-13``). ``|a - b| <= |a - r| + |b - r|`` (the factor 2). Each float32 computation's
    error is a sum of many roundings, each ``<= u`` relative, spread through the same products, norms and
    softmaxes; another accumulation order or kernel draws other roundings of the same size, so its largest
    error over the same entries is of the same size as the measured one, which is the largest over every
    prefix's row of the contexts and a fixed probe of the model (:func:`float32_error`: many draws, not one
    row's). The second factor 2 allows the other computation's largest error to be up to twice the
    measured one's (a kernel with a longer recursive
    accumulation, a less accurate ``exp``, and the maximum's fluctuation between draws). So
    ``|a - b| <= MODEL_FACTOR * measured`` with ``MODEL_FACTOR = 4``. It scales with the model, the weights
    and the contexts (it is measured on them), not with the machine: float32 arithmetic is the same on every
    machine of this kind, and no thread count or batch split changes the size of a rounding.
    """
    if not measured >= 0:
        raise ValueError(f"measured error {measured} is not a nonnegative number")
    where = f" on {what}" if what else ""
    return Bound(factor * measured, f"{factor:g} x the error against float64, {measured:.3g}{where}")


def lower_precision(measured: float, u: float, factor: float = 2.0) -> Bound:
    """Bound on the difference between a run of a model at unit roundoff ``u`` (weights and activations
    rounded to bfloat16 or float16) and a float32 run, from ``measured``: the float32 run's error against
    float64 (:func:`float32_error`).

    Derivation. To first order, every rounding error of a computation is proportional to its unit roundoff:
    the same operations at ``u`` instead of :data:`U32` give errors ``u / U32`` times as large (rounding the
    weights to ``u`` is one more rounding of each product's input). So the low-precision run's error
    against float64 is about ``(u / U32) * measured``; ``factor`` (default 2, as :func:`model_difference`'s
    second factor) allows it to be up to twice that, and the float32 run's own ``measured`` is added. First
    order holds while the scaled error is small against the log-probabilities' spread (``u = 2**-8`` on a
    tiny model: well under 1)."""
    scaled = measured * u / U32
    return Bound(factor * scaled + measured, f"{factor:g} x {u / U32:g} x float32's error {measured:.3g}, plus it")


#: (folder, context, min_logprob) -> the largest error over the context's rows at every position.
_row_errors: dict[tuple[str, tuple[int, ...], float | None], float] = {}
#: How many contexts, of how many tokens, :func:`float32_error`'s fixed probe of a model has.
PROBE_CONTEXTS, PROBE_LENGTH = 4, 64
_probes: dict[str, list[tuple[int, ...]]] = {}


def probe_contexts(folder: str) -> list[tuple[int, ...]]:
    """The fixed probe of the model in ``folder`` (:func:`float32_error`): :data:`PROBE_CONTEXTS` contexts of
    :data:`PROBE_LENGTH` token ids drawn uniformly from its vocabulary, seed 0."""
    if folder not in _probes:
        import numpy as np

        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        vocab = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
        draw = np.random.default_rng(0).integers(0, vocab, size=(PROBE_CONTEXTS, PROBE_LENGTH))
        _probes[folder] = [tuple(int(t) for t in row) for row in draw]
    return _probes[folder]


_models: dict[str, tuple[Any, Any]] = {}  # the last model folder's float32 and float64 copies


def float32_error(model_dir: str, contexts: Sequence[Sequence[int]], min_logprob: float | None = None) -> float:
    """The largest ``|float32 - float64|`` log-probability of the transformers model in ``model_dir`` run
    unbatched in float32 against the same weights in float64, over the next-token rows of ``contexts`` and
    of every prefix of them: the float32 forward pass's own rounding error, the input of
    :func:`model_difference`. With ``min_logprob``, only entries whose float64 log-probability is at least
    that count.

    Why every prefix's row. One row's largest error is one draw of roundings; another computation of that
    row (another kernel, batch split or KV-cache shape) draws other roundings of the same size, whose
    largest can exceed this one draw's (on the tiny Llama, one 310-token context's last rows err by 4e-6
    to 6.5e-6, its rows over all positions by up to 1.2e-5). The largest over every position of the same
    contexts is a maximum over many draws of the same model, weights and tokens, so it stands for the
    model's rounding error on them rather than for one lucky or unlucky row; a causal model computes those
    rows in the same passes anyway. For the same reason the maximum also runs over a fixed probe of the
    model (:data:`PROBE_CONTEXTS` contexts of :data:`PROBE_LENGTH` tokens drawn from its vocabulary with a
    fixed seed): a short context has one or a few rows, too small a sample to stand for the model's error
    level, which :func:`model_difference` assumes the measurement does. Each context's rows are cached,
    and the model's two copies are kept for the next call."""
    folder = str(model_dir)
    asked = {tuple(int(t) for t in c) for c in contexts if len(c)} | set(probe_contexts(folder))
    todo = sorted(c for c in asked if (folder, c, min_logprob) not in _row_errors)
    if todo:
        import torch

        if folder not in _models:
            from transformers import AutoModelForCausalLM

            _models.clear()
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            exact = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
            _models[folder] = (model, exact)
        model, exact = _models[folder]
        for i, context in enumerate(todo):
            if i + 1 < len(todo) and todo[i + 1][: len(context)] == context:
                continue  # a prefix of the next one: that pass gives its rows too
            largest = 0.0  # kept per prefix as the largest over its own positions: each lookup is one entry
            for k, error in enumerate(position_errors(model, exact, context, min_logprob)):
                largest = max(largest, error)
                _row_errors[(folder, context[: k + 1], min_logprob)] = largest
    return max((_row_errors[(folder, c, min_logprob)] for c in asked), default=0.0)


def position_errors(model: Any, exact: Any, context: Sequence[int], min_logprob: float | None = None) -> list[float]:
    """Per position of ``context``, the largest ``|float32 - float64|`` next-token log-probability of one
    unbatched pass of ``model`` (float32) against ``exact`` (the same weights in float64): the measurement
    behind :func:`float32_error`, for a model it cannot load by folder (one under a LoRA adapter, say).
    With ``min_logprob``, only entries whose float64 log-probability is at least that count."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([[int(t) for t in context]])
        rows32 = torch.log_softmax(model(ids).logits[0], -1).double()
        rows64 = torch.log_softmax(exact(ids).logits[0], -1)
    errors = []
    for a, b in zip(rows32, rows64, strict=True):
        diff = (a - b).abs()
        if min_logprob is not None:
            diff = diff[b >= min_logprob]
        errors.append(diff.max().item() if diff.numel() else 0.0)
    return errors


#: What a kit check takes as its tolerance: a number, a function of the compared contexts (such as
#: :func:`rows_bound`'s), or ``None`` for :func:`resolve`'s default.
Tolerance = float | Callable[[Sequence[Sequence[int]]], float] | None


def rows_bound(model_dir: str, factor: float = MODEL_FACTOR) -> Callable[[Sequence[Sequence[int]]], Bound]:
    """A tolerance for rows of the transformers model in ``model_dir`` served by a backend whose matrix
    products change with the batch, thread count or kernels (a :data:`Tolerance` for the kit's checks):
    given the compared contexts, :func:`model_difference` of :func:`float32_error` on those contexts."""

    def tolerance(contexts: Sequence[Sequence[int]]) -> Bound:
        measured = float32_error(model_dir, contexts)
        return model_difference(measured, factor, f"{len(contexts)} contexts")

    return tolerance


def resolve(atol: Tolerance, contexts: Sequence[Sequence[int]], rows: Sequence[Any]) -> Bound:
    """The number a kit check compares with: ``atol`` itself (a number; its ``basis`` kept where it is a
    :class:`Bound`), ``atol(contexts)`` (a function), or, for ``None``, :func:`log_softmax_difference` over
    the rows' vocabulary at their most negative finite entry: the least two computations of the same
    logits differ by. ``None`` therefore assumes the batched paths compute the same logits as the single
    one (an engine whose logits do not depend on the batch, like ``mock``); an engine whose matrix products
    change with the batch passes :func:`rows_bound` or a :func:`model_difference`."""
    if callable(atol):
        got = atol(contexts)
        return got if isinstance(got, Bound) else Bound(float(got), "a tolerance given by the caller")
    if atol is not None:
        return atol if isinstance(atol, Bound) else Bound(float(atol), "a tolerance given by the caller")
    import torch

    lowest = 0.0
    for row in rows:
        finite = row[torch.isfinite(row)]
        if finite.numel():
            lowest = min(lowest, float(finite.min()))
    return log_softmax_difference(int(rows[0].numel()), lowest)


def row_difference(row: Any, other: Any) -> float:
    """The largest ``|row - other|`` in float64 between two tensors of one shape, where an entry that is
    ``-inf`` in both counts 0; an entry ``-inf`` in one only gives ``inf``, and a NaN gives NaN (both then
    fail :func:`within`)."""
    import torch

    a, b = row.double(), other.double()
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} and {tuple(b.shape)}")
    diff = (a - b).abs()
    diff = torch.where(torch.isneginf(a) & torch.isneginf(b), torch.zeros_like(diff), diff)
    if diff.isnan().any():
        return math.nan
    return float(diff.max()) if diff.numel() else 0.0


def record(name: str, diff: float, bound: float) -> None:
    """Append ``{check, tolerance, basis, diff, test, threads}`` to the file named by
    ``GENLM_RECORD_BOUNDS`` (nothing when it is unset)."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    entry = {
        "check": name,
        "tolerance": float(bound),
        "basis": getattr(bound, "basis", ""),
        "diff": float(diff),
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
        "omp_threads": os.environ.get("OMP_NUM_THREADS", ""),
        "batch": os.environ.get("GENLM_BOUNDS_BATCH", ""),
        "pid": os.getpid(),
    }
    line = json.dumps(entry) + "\n"
    with _record_lock, open(path, "a", encoding="utf-8") as f:
        f.write(line)


def within(name: str, diff: float, bound: float, detail: str = "") -> None:
    """Assert ``diff <= bound`` (a NaN ``diff`` fails), naming the check, the bound and its basis; record
    it (:func:`record`) first."""
    record(name, diff, bound)
    if not diff <= bound:
        basis = getattr(bound, "basis", "")
        raise AssertionError(
            f"{name}: difference {diff:.6g} > tolerance {float(bound):.6g}"
            + (f" ({basis})" if basis else "")
            + (f"; {detail}" if detail else "")
        )


__all__ = [
    "FN_ULPS_U",
    "LAMBDA",
    "MODEL_FACTOR",
    "PROBE_CONTEXTS",
    "PROBE_LENGTH",
    "RECORD_ENV",
    "U16",
    "U32",
    "U64",
    "U_BF16",
    "Bound",
    "Tolerance",
    "exact",
    "float32_error",
    "gamma",
    "gamma_probabilistic",
    "log_softmax_difference",
    "log_softmax_error",
    "lower_precision",
    "model_difference",
    "normalisation_error",
    "record",
    "resolve",
    "row_difference",
    "rows_bound",
    "sum_error",
    "within",
]


def tree_sum_depth(parent: Any, depth: Any) -> Any:
    """Per node of a tree, the most roundings any term meets on its way into that node's sum when every
    node's value is the sum of its children's (leaves hold the terms), each node's children added in any
    order into an exact zero: ``r(leaf) = 0``, ``r(node) = (k - 1) + max over children r(child)`` for a
    node with ``k`` children (``k`` terms need ``k - 1`` additions; the first lands on zero exactly).

    ``parent[n]`` is ``n``'s parent (negative for the root), ``depth[n] = depth[parent[n]] + 1``: a
    :class:`~genlm_core.trie.index.TrieIndex`'s ``parent`` and ``depth``. Returns an int64 array."""
    import numpy as np

    parent = np.asarray(parent, dtype=np.int64)
    depth = np.asarray(depth, dtype=np.int64)
    has_parent = parent >= 0
    kids = np.bincount(parent[has_parent], minlength=len(parent))
    own = np.maximum(kids - 1, 0)
    below = np.zeros(len(parent), dtype=np.int64)  # max r over a node's children, so far
    r = np.zeros(len(parent), dtype=np.int64)
    for level in range(int(depth.max(initial=0)), -1, -1):  # deepest first: children are finished
        nodes = np.flatnonzero(depth == level)
        r[nodes] = np.where(kids[nodes] > 0, own[nodes] + below[nodes], 0)
        child = nodes[has_parent[nodes]]
        np.maximum.at(below, parent[child], r[child])
    return r


def tree_sum_error(
    parent: Any, depth: Any, sums: Any, u: float = U64, probabilistic: bool = True, lam: float = LAMBDA
) -> Any:
    """Per-node bound on ``|computed - exact|`` of a trie's node sums of nonnegative weights, computed
    bottom-up in any order (the CPU engine's sweep, the torch engine's ``index_add_`` levels, any thread
    count): ``c_r * S`` where ``r`` is :func:`tree_sum_depth`, ``c_r`` is ``min(gamma_r, gamma~_r(lam))``
    as in :func:`sum_error`, and ``S`` the exact node sum.

    Derivation. A node's computed children ``c_j (1 + t_j)`` with ``|t_j| <= gamma_{r_j}``, summed in any
    order, give ``sum_j c_j (1 + t_j)(1 + e_j)`` with ``|e_j| <= gamma_{k-1}``; ``(1 + gamma_a)(1 +
    gamma_b) <= 1 + gamma_{a+b}``, so the node is off by at most ``gamma_r`` times ``sum_j c_j = S`` (all
    terms are nonnegative, so ``sum |x| = S``: no cancellation). The probabilistic constant composes the
    same way. ``sums`` may be the computed sums: ``S <= computed / (1 - c_r)``, which is used.
    Returns an array shaped like ``sums`` (``[nodes]`` or ``[batch, nodes]``)."""
    import numpy as np

    r = tree_sum_depth(parent, depth)
    worst = r * u / (1 - r * u)
    c = np.minimum(worst, np.expm1(lam * np.sqrt(r) * u + r * u * u / (1 - u))) if probabilistic else worst
    return c / (1 - c) * np.abs(np.asarray(sums, dtype=np.float64))


def within_each(name: str, got: Any, want: Any, tolerance: Any, basis: str = "", detail: str = "") -> None:
    """Assert ``|got - want| <= tolerance`` entry by entry (arrays, or anything numpy takes; ``tolerance``
    broadcasts; equal infinities count as no difference; a NaN fails), naming the worst entry. Records
    (:func:`record`) the entry nearest its tolerance (the largest ``difference / tolerance``), so that
    the recorded margin is the check's smallest."""
    import numpy as np

    a, b = np.broadcast_arrays(np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64))
    tol = np.broadcast_to(np.asarray(tolerance, dtype=np.float64), a.shape)
    with np.errstate(invalid="ignore"):
        diff = np.where(a == b, 0.0, np.abs(a - b))
    diff = np.where(np.isnan(diff), np.inf, diff)
    if diff.size == 0:
        return
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(diff == 0, 0.0, diff / tol)
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    bound = Bound(float(tol[worst]), basis or f"entry by entry, tightest at {tuple(int(i) for i in worst)}")
    record(name, float(diff[worst]), bound)
    if not float(diff[worst]) <= float(bound):
        raise AssertionError(
            f"{name}: difference {float(diff[worst]):.6g} > tolerance {float(bound):.6g} at entry "
            f"{tuple(int(i) for i in worst)} (got {a[worst]!r}, want {b[worst]!r})"
            + (f" ({basis})" if basis else "")
            + (f"; {detail}" if detail else "")
        )


__all__ += ["position_errors", "probe_contexts", "tree_sum_depth", "tree_sum_error", "within_each"]
