"""The default collate of torch-tensor items stacks numpy views of the tensors (no
torch.stack round trip): the batch is bitwise what torch's own stacking gives, for
contiguous, strided, grad-requiring, bfloat16 and integer tensors."""

import numpy as np
import pytest

from jtrain.data import items

torch = pytest.importorskip("torch")


def _torch_way(values):
    arr = torch.stack([v.detach() for v in values])
    return arr.numpy() if arr.dtype != torch.bfloat16 else arr.float().numpy()


@pytest.mark.parametrize("make", [
    lambda g: torch.randn(3, 4, 5, generator=g),
    lambda g: torch.randn(4, 5, 3, generator=g).permute(2, 0, 1).flip(-1),  # strided view
    lambda g: torch.randn(6, generator=g).requires_grad_(),
    lambda g: torch.randn(2, 3, generator=g).to(torch.bfloat16),
    lambda g: torch.randint(0, 1000, (7,), generator=g),  # int64 -> int32
    lambda g: torch.rand(5, generator=g) < 0.5,
])
def test_numpy_stack_of_torch_items_is_bitwise_torch_stack(make):
    g = torch.Generator().manual_seed(0)
    xs = [make(g) for _ in range(9)]
    raws = [(x, i) for i, x in enumerate(xs)]
    ref = items.signature(items.to_numpy_item(raws[0], "d[0]"))
    batch = items.stack_raw(raws, list(range(9)), "d", ref)
    want = _torch_way(xs)
    want = want.astype(np.int32) if want.dtype == np.int64 else want
    assert batch["inputs"].dtype == want.dtype and batch["inputs"].shape == want.shape
    assert batch["inputs"].tobytes() == want.tobytes()
    assert batch["targets"].dtype == np.int32 and list(batch["targets"]) == list(range(9))
    assert batch["inputs"].flags["C_CONTIGUOUS"]


def test_a_mismatched_tensor_is_still_named_by_its_index():
    raws = [(torch.zeros(3), 0), (torch.zeros(3), 1), (torch.zeros(4), 2)]
    ref = items.signature(items.to_numpy_item(raws[0], "d[0]"))
    with pytest.raises(items.DataError, match=r"d\[2\]"):
        items.stack_raw(raws, [0, 1, 2], "d", ref)
