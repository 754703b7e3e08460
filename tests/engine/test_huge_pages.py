"""Packed weights in 2 MiB pages (fly_llm.model.huge_pages): same values, aligned, asked for where Linux can."""

from __future__ import annotations

import pytest
import torch

from fly_llm.model import huge_pages
from fly_llm.model.huge_pages import HUGE_PAGE, in_huge_pages
from fly_llm.model.kernels import w4a8
from fly_llm.model.quantization import quantize
from fly_llm.model.w4a8_layers import W4A8Linear

can_ask = pytest.mark.skipif(huge_pages._madvise() is None, reason="transparent huge pages cannot be asked for here")


@can_ask
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.float32])
def test_a_copy_in_huge_pages_is_equal_and_aligned(dtype):
    tensor = (torch.randn(1500, 1500) * 100).to(dtype)
    copy = in_huge_pages(tensor)
    assert copy.data_ptr() % HUGE_PAGE == 0 and copy.data_ptr() != tensor.data_ptr()
    assert copy.dtype == dtype and copy.shape == tensor.shape and copy.is_contiguous()
    assert torch.equal(copy, tensor)


def test_small_tensors_and_unsupported_systems_are_left_as_they_are(monkeypatch):
    small = torch.zeros(1000)
    assert in_huge_pages(small) is small
    monkeypatch.setattr(huge_pages, "_madvise", lambda: None)
    big = torch.zeros(HUGE_PAGE)
    assert in_huge_pages(big) is big


@can_ask
@pytest.mark.skipif(not w4a8.available(), reason="the w4a8 kernel cannot be built or run here")
def test_a_w4a8_layer_streams_its_weight_from_huge_pages_with_the_same_result():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4160))  # 2 MiB of packed levels
    quantize(model, "w4a8", torch.device("cpu"))
    layer = model[0]
    assert isinstance(layer, W4A8Linear)
    assert layer.packed.q.data_ptr() % HUGE_PAGE == 0
    plain = layer.packed.map(torch.clone)
    x = torch.randn(3, 1024)
    assert torch.equal(layer(x), w4a8.linear(x, plain, layer.bias))
