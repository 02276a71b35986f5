"""``scalars_to_host`` / ``metrics_to_host`` give exactly what ``float`` gives each value (the trainer logs
the same numbers as when it read every metric with ``float``), and ``to_device`` is a plain move off
GPUs. Exact equality, not a tolerance: every float dtype (and an integer below 2**53) widens to float64
without rounding, on the device as ``float`` does on the host."""

from __future__ import annotations

import torch

from reroll.data.transfer import metrics_to_host, scalars_to_host, to_device


def _values() -> list[torch.Tensor | float]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, generator=g)
    return [
        x[0],  # float32
        x[1].to(torch.bfloat16),
        x[2].to(torch.float16),
        x[3].double(),
        torch.tensor(2**40 + 1),  # int64, exact in float64
        torch.tensor(True),
        torch.tensor(float("nan")),
        torch.tensor(float("-inf")),
        x[4].reshape(1),  # one element, not 0-dim
        0.1,  # a Python float passes through
        3,
    ]


def test_scalars_to_host_equals_float_of_each():
    values = _values()
    got = scalars_to_host(values)
    want = [float(v) for v in values]
    assert [type(v) for v in got] == [float] * len(values)
    assert [repr(v) for v in got] == [repr(v) for v in want]  # repr: nan == nan, and -0.0 kept


def test_metrics_to_host_keeps_each_parts_keys_and_order():
    a, b = torch.tensor(0.25), torch.tensor(-1.5)
    parts = [{"x/a": a, "x/b": 2.0}, {}, {"x/b": b}]
    assert metrics_to_host(parts) == [{"x/a": 0.25, "x/b": 2.0}, {}, {"x/b": -1.5}]
    assert list(metrics_to_host(parts)[0]) == ["x/a", "x/b"]


def test_to_device_off_gpus_is_a_plain_move():
    t = torch.arange(3)
    assert to_device(t, "cpu") is t
    assert to_device(t, torch.device("cpu")) is t
