"""The adaptive state's fingerprint (``_core.agreement``): the Adler-32 of the state's bytes, on the host or by tensor ops.

Every rank adds its state's fingerprint to the one all-reduce, and ranks
agree only if every rank's digits are equal, so the digits must be a
function of the bits alone, whichever way a rank computes them: eagerly on
the host from a CPU state's bytes, or by tensor ops (a CUDA state, a traced
step, a state too large for the host). Checked against a reference computed
the obvious way, Adler-32's running sums over each element's bytes with
Python integers (RFC 1950), which is also what ``zlib.adler32`` gives.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppclip_func import init_clip_state
from ppclip_func._core import agreement as _agree
from ppclip_func._core.agreement import host_entries, host_fingerprint, state_entries, state_fingerprint
from ppclip_func._core.norms import norm_kind

ADLER = 65521
CPU = torch.device("cpu")
STATS = torch.zeros(3, dtype=torch.float64)  # statistics the entries join (they take its device)
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8, torch.bool]


def reference(state: list[torch.Tensor]) -> list[int]:
    """Adler-32 of the state's bytes, in order, as ``[A, B]``: ``A`` starts at 1 and adds each byte, ``B``
    adds each new ``A``, both modulo 65521."""
    a, b = 1, 0
    for byte in b"".join(map(bits, state)):
        a = (a + byte) % ADLER
        b = (b + a) % ADLER
    return [a, b]


def bits(t: torch.Tensor) -> bytes:
    """``t``'s elements' bytes, in order."""
    return bytes(t.contiguous().clone().untyped_storage())


def from_bytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``dtype`` holding ``data``'s bits (any bits: NaN payloads, -0.0, denormals)."""
    size = torch.empty((), dtype=dtype).element_size()
    data = data[: len(data) // size * size]
    if dtype == torch.bool:  # a bool holds 0 or 1
        data = bytes(b & 1 for b in data)
    if not data:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).clone()


tensors = st.tuples(st.binary(min_size=0, max_size=64), st.sampled_from(DTYPES)).map(lambda p: from_bytes(*p))
# One element as a 0-dim tensor, as a ClipState holds them (the host reads those through tolist()).
scalars = st.tuples(st.binary(min_size=8, max_size=8), st.sampled_from(DTYPES)).map(
    lambda p: from_bytes(*p)[:1].reshape(())
)
states = st.lists(st.one_of(tensors, scalars), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(states)
def test_the_digits_are_the_reference_on_the_host_and_by_tensor_ops(state):
    want = reference(state)
    check = zlib.adler32(b"".join(map(bits, state)))
    assert want == [check & 0xFFFF, check >> 16]
    assert host_fingerprint(state) == want
    assert state_fingerprint(state, CPU).tolist() == want


@settings(max_examples=200, deadline=None)
@given(states, st.data())
def test_one_flipped_bit_changes_both_digits(state, data):
    flat = [t for t in state if t.numel() > 0 and t.dtype != torch.bool]
    if not flat:
        flat = [torch.tensor([1.5], dtype=torch.float64)]
    k = data.draw(st.integers(0, len(flat) - 1))
    t = flat[k]
    raw = bytearray(bits(t))
    bit = data.draw(st.integers(0, 8 * len(raw) - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    changed = [*flat[:k], from_bytes(bytes(raw), t.dtype).reshape(t.shape), *flat[k + 1 :]]
    # A flip changes one byte by a power of two, never a multiple of the prime: A moves, and so does B (which
    # weighs byte j of n by n - j, below the prime here).
    before, after = host_fingerprint(flat), host_fingerprint(changed)
    assert before[0] != after[0] and before[1] != after[1]


def test_a_clip_state_and_its_entries():
    state = init_clip_state()._replace(count=torch.tensor(17), mean=torch.tensor(1.25, dtype=torch.float64))
    f, l2, inf = reference(list(state)), norm_kind(2.0), norm_kind(float("inf"))
    assert host_fingerprint(state) == f
    assert host_entries(state, l2) == [*f, *(x * x for x in f)]
    assert host_entries(state, inf) == [*f, *(-x for x in f)]
    assert state_entries(state, l2, STATS, host_entries(state, l2)).tolist() == [*f, *(x * x for x in f)]
    assert state_entries(state, inf, STATS, host_entries(state, inf)).tolist() == [*f, *(-x for x in f)]
    assert state_entries(state, l2, STATS, host_entries(state, l2)).dtype == torch.float64


@pytest.mark.parametrize(
    "state",
    [
        pytest.param([torch.arange(12.0, dtype=torch.float64)[::2]], id="non-contiguous"),
        pytest.param([torch.tensor(3), torch.linspace(0, 1, 15)], id="more bytes than the host takes"),
    ],
)
def test_states_the_host_leaves_to_tensor_ops_give_the_same_digits(state, monkeypatch):
    monkeypatch.setattr(_agree, "_HOST_BYTES", 64)  # (4 MiB in the library)
    assert host_fingerprint(state) is None
    want = reference(state)
    assert state_fingerprint(state, CPU).tolist() == want
    assert state_entries(state, norm_kind(2.0), STATS, None).tolist()[:2] == want


def test_bytes_reduced_before_the_sums_give_the_same_digits(monkeypatch):
    # Past 2**26 bytes the products are reduced first (exact in int64 either way): taken here from 64.
    monkeypatch.setattr(_agree, "_UNREDUCED_BYTES", 64)
    state = [torch.tensor(9), torch.randn(500, generator=torch.Generator().manual_seed(0))]
    assert state_fingerprint(state, CPU).tolist() == reference(state) == host_fingerprint(state)


def test_a_traced_fingerprint_is_the_hosts():
    # Traced, the clip takes the entries by tensor ops (no host values: own is None), in one graph.
    state = init_clip_state()._replace(count=torch.tensor(5), var=torch.tensor(0.5, dtype=torch.float64))
    entries = torch.compile(
        lambda s: state_entries(s, norm_kind(2.0), STATS, None), backend="aot_eager", fullgraph=True
    )
    assert (
        entries(state).tolist()
        == state_entries(state, norm_kind(2.0), STATS, host_entries(state, norm_kind(2.0))).tolist()
    )
    assert entries(state).tolist()[:2] == reference(list(state))


def test_a_contiguous_view_is_read_from_its_own_offset():
    whole = torch.arange(10.0, dtype=torch.float64)
    assert host_fingerprint([whole[3:7]]) == reference([whole[3:7]]) != reference([whole[:4]])


@pytest.mark.parametrize("bits", [0x7FF0000000000001, 0xFFF8000000000123, 0x8000000000000000, 0x0000000000000001])
def test_a_0_dim_float64_keeps_its_bits_nan_payloads_and_signed_zero_included(bits):
    t = torch.tensor(bits - (1 << 64) if bits >> 63 else bits, dtype=torch.int64).view(torch.float64)
    assert t.dim() == 0
    assert host_fingerprint([t]) == reference([t]) == state_fingerprint([t], CPU).tolist()
