"""The training side of the service: training clients (adapters + AdamW state) over one frozen base, and
``forward_backward`` batches mixing clients.

A batch is every datum of the requests it serves, each datum one row through its own client's adapter
(:mod:`~spinwheel.tinker.adapters`), right-padded to the longest (causal attention: padding after a token never
changes it), run in micro-batches of at most ``micro_batch_tokens`` padded tokens whose backward passes accumulate
into the clients' gradients. Token log-probs come from the final hidden states a chunk of positions at a time
(:func:`~spinwheel.parallel.chunked_logprobs.chunked_token_logprobs`: never the (tokens x vocab) logits). Each datum's
loss is its request's loss function (:mod:`~spinwheel.tinker.losses`) on its own tokens, so a batch of several
clients computes exactly what each client's requests compute alone, up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spinwheel.models.lora import LoRAConfig
from spinwheel.models.transformer import Transformer
from spinwheel.parallel.chunked_logprobs import chunked_token_logprobs
from spinwheel.tinker.adapters import ClientAdapter, TrainRows, rows_of
from spinwheel.tinker.losses import Loss, LossInputError, check_inputs, get_loss
from spinwheel.tinker.wire import FwdBwdRequest

INPUT_INT_KEYS = ("target_tokens",)


@dataclass
class Row:
    """One datum of one request: its client, tokens (T,), targets (T,), loss and loss inputs."""

    client: str
    tokens: torch.Tensor
    targets: torch.Tensor
    loss: Loss
    config: dict[str, float]
    inputs: dict[str, torch.Tensor]
    request: int  # index of its request in the batch


def _on(inputs: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in inputs.items()}


class UnknownModelError(LookupError):
    """A request names a training client the service does not hold."""


class Trainer:
    def __init__(self, model: Transformer, train_rows: TrainRows, micro_batch_tokens: int = 8192) -> None:
        self.model, self.train_rows = model, train_rows
        self.micro_batch_tokens = micro_batch_tokens
        self.clients: dict[str, ClientAdapter] = {}
        self.vocab_size = model.config.vocab_size

    def client(self, model_id: str) -> ClientAdapter:
        if model_id not in self.clients:
            raise UnknownModelError(f"no training client '{model_id}' in this service: create it first")
        return self.clients[model_id]

    def create(self, model_id: str, config: LoRAConfig, seed: int | None) -> ClientAdapter:
        if model_id in self.clients:
            self.clients.pop(model_id).detach(self.model)
        self.clients[model_id] = ClientAdapter(model_id, self.model, config, seed)
        return self.clients[model_id]

    def rows(self, index: int, req: FwdBwdRequest) -> list[Row]:
        """Request ``index``'s data as rows, every input checked (a LossInputError fails this request only)."""
        self.client(req.model_id)
        loss, config = get_loss(req.loss_fn, req.loss_fn_config)
        out = []
        for i, datum in enumerate(req.data):
            tokens = torch.tensor(datum.tokens, dtype=torch.long)
            check_inputs(loss, req.loss_fn, datum.inputs, len(tokens), i)
            targets = datum.inputs["target_tokens"]
            if targets.is_floating_point():
                raise LossInputError(f"datum {i}: target_tokens must be int64 token ids, got float32")
            for what, ids in (("model_input", tokens), ("target_tokens", targets)):
                bad = ids[(ids < 0) | (ids >= self.vocab_size)]
                if bad.numel():
                    raise LossInputError(
                        f"datum {i}: {what} holds token id {int(bad[0])}, outside the model's vocabulary "
                        f"[0, {self.vocab_size})"
                    )
            inputs = {k: v.to(torch.float32) for k, v in datum.inputs.items() if k not in INPUT_INT_KEYS}
            out.append(Row(req.model_id, tokens, targets.long(), loss, config, inputs, index))
        return out

    def forward_backward(self, rows: list[Row], num_requests: int, backward: bool) -> list[tuple[list, float]]:
        """Run ``rows`` (of ``num_requests`` requests, in order) and, with ``backward``, accumulate each client's
        gradients. Returns per request: (per-datum outputs {"logprobs": (T,)}, the request's loss sum)."""
        outputs: list[list] = [[] for _ in range(num_requests)]
        sums = [0.0] * num_requests
        for batch in self._micro_batches(rows):
            with torch.set_grad_enabled(backward):
                logps = self._logprobs(batch)
                losses = [r.loss.fn(lp, _on(r.inputs, lp.device), r.config) for r, lp in zip(batch, logps)]
                if backward:
                    torch.stack(losses).sum().backward()
            for r, lp, loss in zip(batch, logps, losses):
                outputs[r.request].append({"logprobs": lp.detach()})
                sums[r.request] += float(loss.detach())
        return list(zip(outputs, sums))

    def _micro_batches(self, rows: list[Row]) -> list[list[Row]]:
        """Consecutive runs of at most ``micro_batch_tokens`` padded tokens, each ordered by client (a client's
        rows one slice of the activations: :func:`~spinwheel.tinker.adapters.rows_of`)."""
        batches: list[list[Row]] = []
        longest = 0
        for r in rows:
            longest_then = max(longest, len(r.tokens))
            if batches and longest_then * (len(batches[-1]) + 1) <= self.micro_batch_tokens:
                batches[-1].append(r)
                longest = longest_then
            else:
                batches.append([r])
                longest = len(r.tokens)
        first = {c: i for i, c in reversed(list(enumerate(r.client for r in rows)))}
        return [sorted(b, key=lambda r: first[r.client]) for b in batches]

    def _logprobs(self, batch: list[Row]) -> list[torch.Tensor]:
        """log p(target_t | tokens_<=t) (T_i,) fp32 for each row, through each row's client adapter."""
        device = self.model.device
        width = max(len(r.tokens) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r.tokens)
            ids[i, :n], labels[i, :n], mask[i, :n] = r.tokens, r.targets, 1
        ids, labels, mask = ids.to(device), labels.to(device), mask.to(device)
        with rows_of(self.train_rows, [r.client for r in batch], width):
            padded = None if bool(mask.all()) else mask
            hidden = self.model(ids, attention_mask=padded, return_hidden=True)  # (B, T, C)
        logp, _ = chunked_token_logprobs(hidden, self.model.lm_head, labels)  # (B, T)
        return [logp[i, : len(r.tokens)] for i, r in enumerate(batch)]
