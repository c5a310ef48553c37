"""runtime/messages.py on the host side: a message header reaches a GPU without a synchronous copy.

The header is sent from the side stream (encoder ops) and from the LLM's gradient hand-back; a
synchronous host-to-device copy there would make the host wait for everything queued on the
stream. No GPU is needed: the tensor constructor and the copy are recorded, not run.
"""

from __future__ import annotations

import torch

from optimus_mllm.runtime import messages
from optimus_mllm.runtime.messages import Messenger
from optimus_mllm.runtime.process_groups import Channel


def test_header_build_makes_no_synchronous_host_to_device_copy(monkeypatch):
    made, copies, sent = [], [], []
    make_tensor = torch.tensor

    def tensor(*args, device=None, **kwargs):
        made.append(torch.device(device or "cpu"))  # a device tensor from host data: a sync copy
        return make_tensor(*args, **kwargs)

    def pin_memory(self):
        pinned = self.clone()
        pinned.pinned_for_test = True
        return pinned

    def to(self, device, non_blocking=False, **kwargs):
        copies.append((torch.device(device), non_blocking, getattr(self, "pinned_for_test", False)))
        return self

    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(messages.dist, "isend", lambda t, dst, group: sent.append(t))
    gpu = torch.device("cuda", 0)
    channel = Channel("embeddings", 0, 1)
    messenger = Messenger(0, {channel: object()}, {}, torch.bfloat16, gpu)
    messenger.send("embeddings", 1, torch.zeros(2, 3), (5, 0))
    assert made and all(d.type == "cpu" for d in made), made
    assert copies == [(gpu, True, True)], "the header must come from pinned memory, non-blocking"
    assert sent[0].tolist() == [5, 0] and len(sent) == 2
