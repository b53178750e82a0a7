"""The transport's error when NIXL cannot be imported names the wheel that goes with this
torch: the ``nixl`` meta package loads ``nixl_cu{torch's CUDA major}``, so vLLM 0.33
(torch on CUDA 13) needs nixl-cu13 and vLLM 0.32's CUDA build nixl-cu12."""

from __future__ import annotations

import sys

import pytest
import torch

from kv_connector.wire import nixl_install, nixl_transport
from kv_connector.wire.transport import TransportError


@pytest.mark.parametrize(
    ("cuda", "wheel"), [("13.0", "nixl-cu13"), ("12.8", "nixl-cu12"), (None, "nixl-cu12")]
)
def test_the_wheel_follows_torchs_cuda_major(cuda: str | None, wheel: str) -> None:
    assert nixl_install.nixl_wheel(cuda) == wheel
    assert f"pip install {wheel}==1.5.1 && pip install --no-deps nixl==1.5.1" in nixl_install.install_hint(
        cuda
    )


def test_a_missing_nixl_names_the_wheel_for_this_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nixl._api", None)  # import nixl._api raises ImportError
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(TransportError) as e:
        nixl_transport.NixlTransport("x")
    why = str(e.value)
    assert "pip install nixl-cu13==1.5.1" in why and "CUDA 13.0" in why
    assert "nixl-cu12==1.5.1 (or" not in why
