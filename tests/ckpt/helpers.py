"""Small training states, a deep comparison and a scripted replica server for the checkpoint tests."""

from __future__ import annotations

import random
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ckpt import wire
from ckpt.rng import capture_rng_state


def train_state(
    seed: int = 0, width: int = 32
) -> tuple[dict[str, Any], torch.nn.Sequential, torch.optim.Optimizer]:
    """A real (tiny) training state after two optimizer steps: model, AdamW, scheduler, RNGs, data."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(8, width)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    random.seed(seed)
    np.random.seed(seed)
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": capture_rng_state(),
        "data": {"epoch": 1, "sample_index": 4096 + seed},
        "iteration": 2,
    }
    return state, model, opt


def filled_state(iteration: int, nbytes: int = 1 << 16) -> dict[str, Any]:
    """A state whose every byte is a function of ``iteration`` (to check which snapshot came back)."""
    n = nbytes // 4
    return {
        "w": torch.full((n,), float(iteration)),
        "b": torch.arange(97, dtype=torch.int64) + iteration,
        "iteration": iteration,
    }


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Recursive equality: torch.equal (and same dtype) for tensors, == for the rest."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, path


#: a fake replica server's answer to one request header: the raw bytes to send back
Respond = Callable[[dict[str, Any]], bytes]


def frame(body: bytes) -> bytes:
    """A replica-protocol frame whose header is ``body`` as is (valid JSON or not)."""
    return struct.pack("!4sI", wire.MAGIC, len(body)) + body


class FakePeer:
    """A replica 'server' answering each request by ``respond(header)``'s raw bytes, then closing."""

    def __init__(self, respond: Respond) -> None:
        self.respond = respond
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listener.settimeout(0.2)
        self.addr = f"127.0.0.1:{self.listener.getsockname()[1]}"
        #: the ops requested, in order
        self.ops: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    h = wire.recv_header(conn)
                    self.ops.append(str(h.get("op")))
                    conn.sendall(self.respond(h))
                    conn.shutdown(socket.SHUT_WR)
                    conn.recv(1 << 20)  # let the client read everything before the close
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.listener.close()
