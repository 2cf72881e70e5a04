"""A worker's identity: its id, the model it serves and its role, as it registers and
answers with them (shared by the decoder's and the embedding worker's servicers)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerIdentity:
    worker_id: str
    model: str
    role: str
