"""Ranks that disagree: one clear error on every rank, never a wrong norm or a hang.

Every rank of the world must call the clip alike: the same options, and, for
the adaptive clips, the same state. Two checks see to it, neither of which
adds a collective to the steady state:

* **Static options**, checked the first time a configuration is seen on a
  world group (:func:`check_options`): each rank hashes each option to one
  int64 and all-gathers a row of fixed size (so ranks that differ even in
  the number of groups, or in the function they call, still join the same
  gather and it cannot hang). Every rank then reads the same table and
  raises the same :class:`Disagreement`, naming each option and the ranks
  that differ, before the statistics collective and before any gradient is
  scaled. The configuration is then remembered (the latest 64 per function
  and group), as the pipeline-stage table is: later calls compare it on the
  host and issue nothing. What this cannot see: one rank meeting a new
  configuration while another repeats one it remembers (the first gathers,
  the second goes on to the all-reduce, and they hang until the backend's
  timeout); only a collective every step could.
  ``tied=`` is
  per stage (a stage declares the tied leaves it holds): the ranks of one
  stage must agree on it, and across stages the declarations must pair up
  (a parameter tied to ``n`` stages is declared, with ``n``, on ``n`` of
  them). Under ``torch.compile`` the check runs at trace time.
* **Adaptive state**, checked every step inside the one collective
  (:func:`state_entries`, :func:`states_agree`): each rank adds an integer
  fingerprint ``f`` of the state's bits (the two 16-bit digits of the
  Adler-32 checksum of its bytes), and its square, to the reduced
  vector. After a sum, ``sum(f) == W * f`` and ``sum(f**2) == W * f**2`` on
  a rank hold only if every rank's ``f`` is that rank's (the squared
  deviations from ``f`` sum to zero), so the ranks agree or all of them see
  that they do not; a ``max``/``min`` reduction carries ``f`` and ``-f``.
  Exact in float64 up to 2**21 ranks. Eagerly on the CPU, where the state
  and the reduced vector are already on the host, the fingerprint is taken
  from the state's bytes and the decision read there (on a CPU, an eighth
  of the time of the same arithmetic as tensor ops) and a disagreement
  raises at once; traced, or on CUDA, nothing is read on the host: a disagreement
  stops the step with ``torch._assert_async`` and, where that cannot raise
  at once (CUDA), makes the step a no-op (threshold ``inf``, ``skip``
  true), so no gradient is scaled by a decision the ranks do not share.
"""

from __future__ import annotations

import array
import ctypes
import functools
import hashlib
import math
import struct
import threading
import types
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._base import torch_compat
from .._base.caches import follow_process_group, per_group, per_process
from .._base.devices import reads_on_host
from .layout import World, device_of
from .norms import NormKind

__all__: list[str] = []

FIX = (
    "every rank must call the clip with the same options; for groups=, build the mapping from the whole "
    "model's parameter names on every rank (e.g. groups={n: n for n in full_model_names}), not from this "
    "pipeline stage's own named_parameters(); for tied=, each of the n stages holding a tied parameter "
    "declares it with n"
)
STATE_FIX = (
    "every rank must start from the same state (the init_*_state() function on every rank, or the same "
    "checkpoint restored on every rank) and pass the state the previous step returned"
)

# The static check's row: which options were passed, the rank's pipeline stage, its tied= declarations
# (hash, tally, count), then one hash per option, padded. Fixed size, whatever a rank passed.
_MAX_OPTIONS = 24
_HEAD = ("the options passed (which clip function)", "stage", "tied", "tied tally", "tied count")
# A tied declaration with n stages adds _TALLY // n: exact for n <= 16; the stages' sum is a multiple
# of _TALLY when every tied parameter is declared on as many stages as it says.
_TALLY = 720720  # lcm(1, ..., 16)

# The state fingerprint: the Adler-32 checksum of the state's bytes, as its two 16-bit digits.
_ADLER = 65521  # Adler-32's modulus, the largest prime below 2**16
_DIGITS = 2
STATE_ENTRIES = 2 * _DIGITS
_UNREDUCED_BYTES = 2**26  # bytes whose weighted sum is exact in int64 without reducing them first
_HOST_BYTES = 1 << 22  # the most bytes fingerprinted on the host (copied, then zlib.adler32: faster than tensor ops)
_ASSERTS = frozenset({"cpu", "cuda"})  # devices with a torch._assert_async kernel

_REMEMBERED = 64  # configurations remembered per group and function, the latest ones
# (group name, option names) -> the option values every rank agreed on, per default process group.
_VERIFIED: dict[tuple, list[tuple]] = per_group({})


class Disagreement(ValueError):
    """Ranks passed different static options; raised alike on every rank, before any gradient is scaled."""


class StateDisagreement(RuntimeError):
    """Ranks passed different adaptive states; raised alike on every rank, before any gradient is scaled."""


def check_options(world: World, options: Mapping[str, Any], tied: Mapping[str, int] | None) -> None:
    """Raises :class:`Disagreement` on every rank of ``world`` unless all ranks pass the same options.

    ``options`` maps each option's name to its value (plain Python; tensors
    are not compared). Collective only the first time a configuration is
    seen on the world's group; afterwards an equality test on the host.
    """
    if world.group_name is None:
        return
    names, values = tuple(options), (*options.values(), tied)
    if len(names) > _MAX_OPTIONS:
        raise AssertionError(f"_agree: {len(names)} options, room for {_MAX_OPTIONS}")
    if torch.compiler.is_compiling():
        # The options are constants of the graph (dynamo guards on them). A rank may retrace alone (a guard
        # that fails on it only): the remembered configurations keep it from gathering alone then.
        _verify_at_trace_time(world.group_name, _device_type(world), world.rank_stage, names, values)
    else:
        _verify(world.group_name, _device_type(world), world.rank_stage, names, values)


def check_call(
    world: World, key: tuple | None, options: Callable[[], Mapping[str, Any]], tied: Mapping[str, int] | None
) -> None:
    """:func:`check_options` for one call of a clip, with a fast path for a training loop repeating its call.

    ``key`` is the call's configuration as given, a flat tuple (its norm,
    its state's type, its options' fields): when it equals the last one
    verified on the world's group (and its mappings are in the same order),
    that comparison is all the check costs, and ``options()``, the options
    as :func:`check_options` compares them, is not even built. ``None``
    while tracing: the check then runs at trace time, and the graph holds none.
    """
    if world.group_name is None:
        return
    if key is None:
        check_options(world, options(), tied)
        return
    follow_process_group()  # a key verified under another default process group is forgotten
    last = _LAST_CALL.get(world.group_name)
    if last is not None and _as_last(key, *last):
        return
    check_options(world, options(), tied)
    _LAST_CALL[world.group_name] = (_snapshot(key), _mapping_positions(key))


# Group name -> the last call's key verified there (check_call), as _snapshot copies it, and where its
# mappings are.
_LAST_CALL: dict[str, tuple[tuple, tuple[int, ...]]] = per_group({})


def forget_configurations() -> None:
    """Forgets every configuration verified: the next call of each is checked with a gather again (tests
    use it to start the ranks from the same, empty memory)."""
    _VERIFIED.clear()
    _LAST_CALL.clear()


def _device_type(world: World) -> str:
    return world.mesh.device_type if world.mesh is not None else "cpu"


def _verify(
    group_name: str, device_type: str, rank_stage: dict[int, tuple[int, ...]], names: tuple[str, ...], values: tuple
) -> None:
    follow_process_group()  # configurations agreed on under another default process group are forgotten
    seen = _VERIFIED.setdefault((group_name, names), [])
    if any(_same(values, v) for v in reversed(seen)):  # the latest first (check_call has tried the last call)
        return
    _check(group_name, device_type, rank_stage, names, values)
    seen.append(_snapshot(values))
    del seen[:-_REMEMBERED]


@torch.compiler.assume_constant_result
def _verify_at_trace_time(group_name: str, device_type: str, rank_stage: dict, names: tuple, values: tuple) -> bool:
    # Dynamo runs this eagerly with the real arguments; the gather is made outside the fake mode.
    # Raised here, torch.compile(fullgraph=True) raises it as the cause of its InternalTorchDynamoError.
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        _verify(group_name, device_type, rank_stage, names, values)
    return True


def _check(
    group_name: str, device_type: str, rank_stage: dict[int, tuple[int, ...]], names: tuple[str, ...], values: tuple
) -> None:
    if not _moves_data(group_name):
        return  # torch's fake process group (a test tool) gathers nothing: there is nothing to compare
    *options, tied = values
    decl = dict(tied) if isinstance(tied, Mapping) else {}
    tally = sum(_TALLY // n for n in decl.values() if isinstance(n, int) and 1 <= n <= 16)
    rank = dist.get_rank()
    row = [_hash(names), _hash(rank_stage.get(rank)), _hash(tied), tally, len(decl)]
    row += [_hash(v) for v in options] + [0] * (_MAX_OPTIONS - len(options))
    table = _all_gather_rows(group_name, row, device_type)
    if problems := _problems(
        table, names, dist.get_process_group_ranks(torch_compat.resolve_group(group_name)), rank_stage
    ):
        raise Disagreement(f"ranks disagree on {'; '.join(problems)}: {FIX}")


def _problems(
    table: list[list[int]], names: tuple[str, ...], ranks: list[int], rank_stage: dict[int, tuple[int, ...]]
) -> list[str]:
    """What the gathered rows disagree on, worded alike on every rank (they all hold the same table)."""
    problems = []
    columns = (*_HEAD, *names)
    for j, name in enumerate(columns):
        if name in ("stage", "tied", "tied tally", "tied count"):
            continue
        odd = [r for r, row in zip(ranks, table) if row[j] != table[0][j]]
        if odd:
            problems.append(f"{name} ({_some(odd)} from rank {ranks[0]})")
            if j == 0:
                break  # different functions: their option columns do not line up
    # tied=: alike within each stage; across stages, every declaration paired with its peers.
    stages: dict[int, list[tuple[int, list[int]]]] = {}
    for r, row in zip(ranks, table):
        stages.setdefault(row[1], []).append((r, row))
    for members in stages.values():
        first_rank, first = members[0]
        odd = [r for r, row in members if row[2] != first[2]]
        if odd:
            problems.append(f"tied ({_some(odd)} from rank {first_rank} of the same pipeline stage)")
    if not problems:
        firsts = [members[0] for members in stages.values()]
        if sum(row[3] for _, row in firsts) % _TALLY:
            declared = ", ".join(f"stage {rank_stage.get(r)}: {row[4]}" for r, row in firsts)
            problems.append(
                "tied (the declarations do not pair up across pipeline stages: a parameter tied to n stages "
                f"must be declared, with n, on each of them; tied names declared per stage: {declared})"
            )
    return problems


def _all_gather_rows(group_name: str, row: list[int], device_type: str) -> list[list[int]]:
    """Every rank's ``row``, in group rank order, on the device the world mesh's backend uses."""
    group = torch_compat.resolve_group(group_name)
    size = dist.get_world_size(group)
    device = device_of(device_type)
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    table = torch.empty(size * len(row), dtype=torch.int64, device=device)
    torch_compat.all_gather_into(table, mine, group)
    return table.view(size, -1).tolist()


def _some(ranks: list[int]) -> str:
    """``rank 3 differs``, ``ranks [1, 2] differ``, ``ranks [1, 2, ...] (4095) differ``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} differs"
    more = f", ...] ({len(ranks)})" if len(ranks) > 8 else "]"
    return f"ranks [{', '.join(map(str, ranks[:8]))}{more} differ"


def _hash(value: Any) -> int:
    digest = hashlib.blake2b(_text(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _text(value: Any) -> str:
    """A text for ``value`` that is the same in every process (``repr`` of a function holds its address)."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_text(k)}: {_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(map(_text, value))) + "}"
    if isinstance(value, (list, tuple)):
        return type(value).__name__ + "(" + ", ".join(map(_text, value)) + ")"
    if isinstance(value, torch.Tensor):
        return "<tensor>"  # a value on the device: not a static option
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(float(value))  # eps=0 and eps=0.0 are the same option
    if callable(value) and not isinstance(value, type):
        return f"<callable {getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__name__)}>"
    return repr(value)


def _snapshot(values: tuple) -> tuple:
    """``values`` with its mappings and lists copied: a dict changed in place later is a new configuration."""
    return tuple(dict(v) if isinstance(v, Mapping) else tuple(v) if isinstance(v, list) else v for v in values)


def _mapping_positions(values: tuple) -> tuple[int, ...]:
    return tuple(i for i, v in enumerate(values) if isinstance(v, Mapping))


def _as_last(values: tuple, seen: tuple, maps: tuple[int, ...]) -> bool:
    """:func:`_same`'s answer where it is quick to give (a few us less per clip): the tuples equal by
    Python's own comparison, which takes each value by identity first, and the mappings (at ``maps``, found
    once by :func:`_mapping_positions`: an ABC's ``isinstance`` per option would cost more than the rest) in
    the same order (a dict's equality ignores order); else ``False``, and :func:`_same` decides."""
    try:
        equal = values == seen
    except Exception:  # a value whose == cannot give a bool (a tensor of several elements)
        return False
    return equal is True and all(list(values[i]) == list(seen[i]) for i in maps)


def _same(values: tuple, seen: tuple) -> bool:
    return len(values) == len(seen) and all(_equal(a, b) for a, b in zip(values, seen))


def _equal(a: Any, b: Any) -> bool:
    """Whether an option's value is the one verified before, on the host: identity first (the same
    ``ParamIndex`` names every step), a mapping by its items, a tensor only as being a tensor."""
    if a is b:
        return True
    if isinstance(a, types.FunctionType) and isinstance(b, types.FunctionType):
        # The same code with the same captured values and defaults (a lambda written inline in the
        # training loop is a new object every step, and must not be a new configuration every step).
        return (
            a.__code__ is b.__code__
            and _same(a.__defaults__ or (), b.__defaults__ or ())
            and _same(_cells(a), _cells(b))
            and a.__kwdefaults__ == b.__kwdefaults__
        )
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return _same((a.func, a.args, a.keywords), (b.func, b.args, b.keywords))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if isinstance(a, Mapping):
        if not isinstance(b, dict) or len(a) != len(b):
            return False
        a = a if isinstance(a, dict) else dict(a)
        # In order: a mapping's order is the order of its entries in the reduced vector (groups=). Most
        # calls pass the very values seen before, which the dicts' own comparison sees at once (by
        # identity first); value by value only where that fails (a predicate written inline).
        return list(a) == list(b) and (a == b or all(_equal(a[k], b[k]) for k in a))
    if isinstance(a, list):
        a = tuple(a)
    return type(a) is type(b) and bool(a == b)


def _cells(f: types.FunctionType) -> tuple:
    """The values a function's closure captured (an empty cell as a marker of its own)."""
    out = []
    for cell in f.__closure__ or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # a cell not filled yet
            out.append(_EMPTY_CELL)
    return tuple(out)


_EMPTY_CELL = object()


def agreed(**options: Any) -> tuple[tuple[str, Any], ...]:
    """A caller's own static options, for :attr:`NormOptions.also_agree`, each :func:`marked` (for options
    that may hold tensors, as a mapping of thresholds does: a repeated call compares them as given)."""
    return tuple((name, marked(value)) for name, value in options.items())


def rule_fields(rule: tuple[Any, ...]) -> tuple[Any, ...]:
    """A rule's fields but its first, ``max_norm``: what every rank must pass alike. The global threshold may
    follow a schedule, and a new value every step would be a new configuration, and a gather, every step."""
    return tuple(rule[1:])


def label_set(labels: Any) -> Any:
    """``exclude=``'s labels as a set (a list and a set of the same labels are one option), or as given."""
    return frozenset(labels) if isinstance(labels, (list, tuple, set, frozenset)) else labels


_PLAIN = frozenset({bool, int, float, str, type(None), frozenset})  # option types holding no tensor


def marked(value: Any) -> Any:
    """An option's value as the check hashes it and compares it on a miss: a tensor (one among a rule's
    fields or in a mapping of thresholds) is a value on the device, not compared: it is replaced by a mark,
    as comparing it on the host would read it."""
    if type(value) in _PLAIN:
        return value
    if isinstance(value, torch.Tensor):
        return "<tensor>"
    if isinstance(value, tuple):
        return tuple(map(marked, value))
    if isinstance(value, Mapping):
        return {k: marked(v) for k, v in value.items()}
    return value


def carries_state(world: World) -> bool:
    """Whether the state's fingerprint can ride in ``world``'s collective: it has one, and its backend
    moves data (torch's fake process group, a test tool, returns each rank's own vector: no check)."""
    return world.group_name is not None and _moves_data(world.group_name)


@torch.compiler.assume_constant_result
def _moves_data(group_name: str) -> bool:
    follow_process_group()
    moves = _MOVES_DATA.get(group_name)
    if moves is None:  # resolving the group and its backend costs more than the rest: once per group
        moves = _MOVES_DATA[group_name] = str(dist.get_backend(torch_compat.resolve_group(group_name))) != "fake"
    return moves


_MOVES_DATA: dict[str, bool] = per_group({})


def state_entries(
    state: Sequence[torch.Tensor], kind: NormKind, stats: torch.Tensor, own: list[int] | None
) -> torch.Tensor:
    """Returns the :data:`STATE_ENTRIES` values a rank adds to its statistics ``stats``, on their device:
    the state's fingerprint ``f`` (:func:`state_fingerprint`) and ``f**2`` for a sum, ``f`` and ``-f`` for
    a max or min; integers below 2**32, as float64 on the host path and as int64 by tensor ops (one kernel
    fewer: the concatenation with the float64 statistics converts them).

    ``own`` is :func:`host_entries`' answer for ``state``, taken by the
    caller: the values computed on the host from the state's bytes
    (eagerly, for a state on the CPU), which are written into a buffer of
    this thread's (:func:`_buffered`: valid until its next call, so the
    caller copies them at once). ``None``: by tensor ops. Both give the same
    integers (``tests/test_state_fingerprint.py``).
    """
    if own is not None:
        values = _buffered(own)
        return values if stats.is_cpu else values.to(stats.device)
    f = state_fingerprint(state, stats.device)
    return torch.cat([f, f * f if kind.op == "sum" else -f])


def host_entries(state: Sequence[torch.Tensor], kind: NormKind) -> list[int] | None:
    """:func:`state_entries`' values computed on the host, as Python ints, from :func:`host_fingerprint`'s
    digits (a fraction of the tensor ops' time, each op being a dispatch); ``None`` where that cannot be done (then the tensor ops take it). Eager only: the clip does not call
    it while tracing."""
    digits = host_fingerprint(state)
    if digits is None:
        return None
    a, b = digits
    return [a, b, a * a, b * b] if kind.op == "sum" else [a, b, -a, -b]


_ENTRY_BUFFERS = threading.local()


def _buffered(values: list[int]) -> torch.Tensor:
    """The :data:`STATE_ENTRIES` ``values`` as a float64 CPU tensor over a buffer of this thread's, written
    in place: no torch op (a new tensor a step would be one more allocation in the clip). It holds them until this
    thread's next call; the clip copies them into its statistics at once."""
    slot = getattr(_ENTRY_BUFFERS, "slot", None)
    if slot is None:
        buffer = array.array("d", bytes(8 * STATE_ENTRIES))
        slot = _ENTRY_BUFFERS.slot = (buffer, torch.frombuffer(buffer, dtype=torch.float64))
    buffer, tensor = slot
    buffer[0], buffer[1], buffer[2], buffer[3] = values
    return tensor


def state_fingerprint(state: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The Adler-32 checksum of ``state``'s bytes, in order, as its two digits ``[A, B]`` (int64, each in
    ``[0, 65521)``, on ``device``), by tensor ops: what ``zlib.adler32`` gives as ``B << 16 | A``.

    With ``d_0 .. d_{n-1}`` the bytes, ``A = 1 + sum(d_j)`` and ``B = n +
    sum((n - j) * d_j)``, both modulo 65521. A change of one byte is seen by
    ``A`` (and by ``B`` unless ``n - j`` is a multiple of 65521); a change
    of several escapes both only by a coincidence of two linear sums modulo
    the prime. Bits are compared, so the ranks' states must be equal to the
    bit, as they are when every rank computes them with the same ops from
    the same reduced norm. Exact in int64: up to 2**26 bytes need no
    reduction before the sums (more are reduced first).
    """
    data = [b if b.device == device else b.to(device) for b in map(_bytes, state)]
    n = sum(b.numel() for b in data)
    weights, one = _weights(n, device)
    # One more byte, 1, weighed 1 and n: where the sums start (no op of its own).
    terms = weights * torch.cat([*data, one])  # (2, n + 1)
    if n > _UNREDUCED_BYTES:
        terms = terms.remainder(_ADLER)
    return terms.sum(dim=1).remainder(_ADLER)


def state_poison(device: torch.device) -> torch.Tensor:
    """What a rank that cannot take part sends in the state's entries: NaN, which every rank lets pass
    (its peers get a NaN norm, and that rank raises its own error)."""
    return torch.full((STATE_ENTRIES,), math.nan, dtype=torch.float64, device=device)


def states_agree(
    reduced: torch.Tensor,
    entries: torch.Tensor,
    total: torch.Tensor,
    kind: NormKind,
    world: World,
    state_type: type,
    own: list[int] | None,
) -> torch.Tensor | None:
    """Stops the step unless every rank's state is this rank's; returns that as a 0-dim bool for the caller
    to guard its scaling with where the stop may come later (on CUDA, or compiled), else ``None``.

    ``reduced`` is the all-reduced vector, whose last :data:`STATE_ENTRIES`
    values are the ranks' fingerprints combined; ``entries`` this rank's own
    (:func:`state_entries`, made from ``own`` where those were computed on
    the host, :func:`host_entries`). A NaN ``total`` lets the step pass: a
    peer failed before its statistics (``_core.failure.release_peers``; its own error says
    why; a max/min all-reduce may drop its NaN entries, the norm's levels
    keep it) or a gradient is NaN, and the step is not taken. The stop:
    eagerly on the CPU a :class:`StateDisagreement` raised here, naming the
    ranks (one more gather, on this error path only, where every rank is);
    on CUDA and compiled ``torch._assert_async`` (on CUDA a device-side
    assert: the process must be restarted).
    """
    assert world.mesh is not None
    # A sum adds every rank's own (the expected value is own times the world's size); a max or min, one.
    if own is not None and reduced.is_cpu:
        # Eagerly on the CPU (the host took the fingerprint) the collective has been waited for: the
        # decision is read on the host, as exact integers below 2**53. (The ranks counted from the
        # world's table: DeviceMesh.size() costs a few us on a path this short; dynamo cannot read it.)
        ranks = len(world.rank_stage) if kind.op == "sum" else 1
        if reduced[-STATE_ENTRIES:].tolist() == list(map(ranks.__mul__, own)) or math.isnan(total):
            return None
        raise StateDisagreement(f"{_state_message(state_type)} ({_state_ranks(world, own[:_DIGITS])})")
    message = _state_message(state_type)
    ranks = world.mesh.size() if kind.op == "sum" else 1  # an int: int64 entries stay int64 (exact)
    agree = (reduced[-STATE_ENTRIES:] == entries * ranks).all() | total.isnan()
    if agree.device.type in _ASSERTS:
        torch._assert_async(agree, message)
    return agree  # elsewhere the guard alone: the step is a no-op and skipped


def _state_message(state_type: type) -> str:
    what = _STATE_NAMES.get(state_type.__name__, "adaptive states")
    return f"ranks hold different {what}: {STATE_FIX}"


_STATE_NAMES = {
    "ClipState": "adaptive clip states (ClipState: count, mean, var)",
    "AdaGCState": "AdaGC states (AdaGCState: count, gamma)",
}


def _state_ranks(world: World, digits: list[int]) -> str:
    """Which ranks' state differs from the first rank's: one gather, made by every rank (all of them are here)."""
    assert world.group_name is not None and world.mesh is not None
    table = _all_gather_rows(world.group_name, digits, world.mesh.device_type)
    ranks = dist.get_process_group_ranks(torch_compat.resolve_group(world.group_name))
    odd = [r for r, row in zip(ranks, table) if row != table[0]]
    return f"{_some(odd)} from rank {ranks[0]}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements' bytes, in order, as a 1-D uint8 tensor."""
    flat = (t.detach() if t.requires_grad else t).reshape(-1)
    if not flat.is_contiguous():  # a strided view: its elements copied, in order
        flat = flat.contiguous()
    return flat.view(torch.uint8)


_WEIGHT_CACHE: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = per_process({})


def _weights(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Adler-32's weights for ``n`` bytes and a last one where the sums start, as int64 on ``device``:
    ``(2, n + 1)``, ones and ``n - j`` for byte ``j``, then ``1`` and ``n``; and that last byte, ``1``, as
    uint8 (cached eagerly; traced, made in the graph)."""
    if not torch.compiler.is_compiling() and (n, device) in _WEIGHT_CACHE:
        return _WEIGHT_CACHE[n, device]
    down = torch.arange(n + 1, 0, -1, device=device) - 1  # n .. 0
    down[n] = n
    weights = (torch.stack([torch.ones_like(down), down]), torch.ones(1, dtype=torch.uint8, device=device))
    if not torch.compiler.is_compiling():
        _WEIGHT_CACHE[n, device] = weights
    return weights


def host_fingerprint(state: Sequence[torch.Tensor]) -> list[int] | None:
    """:func:`state_fingerprint`'s digits computed on the host from the tensors' bytes (``zlib.adler32``),
    as Python ints; ``None`` where that cannot be done: for a tensor that is not a plain contiguous CPU
    tensor (a subclass, a CUDA tensor), or for a state of more than :data:`_HOST_BYTES`. Eager only: the
    clip does not call it while tracing."""
    data = _host_bytes(state)
    if data is None:
        return None
    check = zlib.adler32(data)
    return [check & 0xFFFF, check >> 16]


def _host_bytes(state: Sequence[torch.Tensor]) -> bytes | None:
    """The bytes of ``state``'s tensors, in order, read on the host; ``None`` where :func:`host_fingerprint`
    says."""
    codes = "="
    for t in state:
        code = _EXACT_SCALARS.get(t.dtype) if reads_on_host(t) and t.dim() == 0 else None
        if code is None:
            break
        codes += code
    else:
        # Every tensor a 0-dim one whose Python value holds its bits exactly (a ClipState's three are
        # such): their values packed, faster than reading each one's memory. (tolist, not item: the faster
        # of the two inside the clip, where this code runs cold once a step.)
        return struct.pack(codes, *[t.tolist() for t in state])
    parts, size = [], 0
    for t in state:
        if not reads_on_host(t) or not t.is_contiguous():
            return None
        size += t.nbytes
        if size > _HOST_BYTES:
            return None
        parts.append(ctypes.string_at(t.data_ptr(), t.nbytes))
    return b"".join(parts)


# dtypes whose 0-dim tensors' Python values (tolist) hold the very bits, with struct's format for them.
_EXACT_SCALARS = {torch.int64: "q", torch.float64: "d", torch.int32: "i"}
