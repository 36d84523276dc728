"""fastamp's DDP used by the client libraries, with the recipes of docs/ddp.md, against the same
library using torch's DDP (real packages, 2 gloo ranks on CPU). Tier: `make test-clients`."""

import socket

import pytest
import torch.multiprocessing as mp

from tests.parallel import _client_workers as W

pytestmark = pytest.mark.clients


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_accelerate_unwraps_and_prepares():
    pytest.importorskip("accelerate")
    mp.spawn(W.accelerate_prepare, args=(2, _port()), nprocs=2, join=True)


def test_transformers_trainer_saves_and_resumes_the_model(tmp_path):
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    mp.spawn(W.transformers_trainer, args=(2, _port(), str(tmp_path)), nprocs=2, join=True)


def test_lightning_strategy_recipe(tmp_path):
    pytest.importorskip("lightning")
    mp.spawn(W.lightning_strategy, args=(2, _port(), str(tmp_path)), nprocs=2, join=True)
