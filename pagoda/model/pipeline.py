"""Pipeline parallelism for the Llama family: which layers a stage holds, and the hand-over of
hidden states from one stage to the next.

Stage s of `size` holds a contiguous run of layers (`layer_range`, as even as they go); the first
stage also the embedding, the last the final norm and the LM head (and the embedding too when the
head is tied to it). A stage's layers index its own KV cache from 0. Between stages the hidden
state and the residual stream travel as one [2, T, H] tensor, from each TP rank of a stage to the
same TP rank of the next (global rank + tp).

Sends are asynchronous: a stage hands a micro-batch to the next stage and starts the following one
while the next stage computes, which is what lets two micro-batches of a step overlap (the
executor splits a step in two, see mp_executor). A send's buffer is kept until it completes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def layer_range(num_layers: int, stage: int, size: int) -> tuple[int, int]:
    return stage * num_layers // size, (stage + 1) * num_layers // size


@dataclass
class PPStage:
    """This process's stage; `tp_size` ranks per stage, so the peer stages' ranks are rank +- tp_size."""

    stage: int = 0
    size: int = 1
    rank: int = 0  # global
    tp_size: int = 1
    _pending: list = field(default_factory=list)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def send(self, h: torch.Tensor, residual: torch.Tensor) -> None:
        import torch.distributed as dist

        self._finish_sends()
        buf = torch.stack([h, residual]).contiguous()
        self._pending.append((dist.isend(buf, self.rank + self.tp_size), buf))

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        buf = torch.empty(2, num_tokens, hidden_size, dtype=dtype)
        dist.recv(buf, self.rank - self.tp_size)
        return buf[0], buf[1]

    def _finish_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


SINGLE_STAGE = PPStage()
