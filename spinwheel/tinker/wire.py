"""The Tinker wire format: protobuf for forward_backward requests and for forward_backward / sample results.

The SDK (``tinker`` 0.38) sends ``/api/v1/forward_backward`` as a ``tinker_public.ForwardBackwardRequest`` protobuf
(optionally zstd-compressed) and asks for ``ForwardBackwardOutput`` and ``SampleResponse`` results as protobuf
(``Accept: application/x-protobuf``); everything else is JSON. The message classes are the SDK's own generated
module (``tinker.proto.tinker_public_pb2``), so the service speaks exactly the schema the client was built with.

Decoded here into plain types: a :class:`Datum` is the token ids of its model input and its loss inputs as tensors
(tokens int32 on the wire -> int64; TensorData float32 / int64, dense or CSR).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from spinwheel.tinker.losses import LossInputError


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclass
class Datum:
    tokens: list[int]
    inputs: dict[str, torch.Tensor]


@dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    data: list[Datum]


def _tensor(msg, where: str) -> torch.Tensor:
    pb = _pb()
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if msg.dtype not in dtypes:
        raise LossInputError(f"{where}: dtype {msg.dtype} is not float32 or int64")
    dtype, shape = dtypes[msg.dtype], list(msg.shape)
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        if len(shape) != 2:
            raise LossInputError(f"{where}: a sparse CSR tensor must be 2-D, got shape {shape}")
        values = np.frombuffer(csr.values, dtype=dtype)
        crow, col = np.frombuffer(csr.crow_indices, np.int64), np.frombuffer(csr.col_indices, np.int64)
        try:
            dense = torch.sparse_csr_tensor(crow, col, values.copy(), size=shape).to_dense()
        except RuntimeError as e:
            raise LossInputError(f"{where}: inconsistent sparse CSR tensor ({e})") from None
        return dense if dtype != np.int32 else dense.long()
    flat = np.frombuffer(msg.dense, dtype=dtype)
    if not shape:
        shape = [flat.size]
    if int(np.prod(shape)) != flat.size:
        raise LossInputError(f"{where}: {flat.size} values do not fill the declared shape {shape}")
    out = torch.from_numpy(flat.copy()).reshape(shape)
    return out.long() if dtype == np.int32 else out


def _tokens(datum_msg, index: int) -> list[int]:
    tokens: list[int] = []
    for chunk in datum_msg.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise LossInputError(f"datum {index}: model_input chunk of type '{kind}': this service takes token chunks")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    if not tokens:
        raise LossInputError(f"datum {index}: empty model_input")
    return tokens


def decode_forward_backward(body: bytes, content_encoding: str | None) -> FwdBwdRequest:
    """A ``/api/v1/forward_backward`` body -> :class:`FwdBwdRequest`; an undecodable one is a LossInputError."""
    if content_encoding == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError
        raise LossInputError(f"forward_backward body is not a ForwardBackwardRequest protobuf ({e})") from None
    config: dict[str, float] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise LossInputError(f"loss_fn_config '{key}' is text ({value.text!r}): the built-in losses take numbers")
        config[key] = value.number
    data = [
        Datum(_tokens(d, i), {k: _tensor(v, f"datum {i} loss_fn_inputs '{k}'") for k, v in d.loss_fn_inputs.items()})
        for i, d in enumerate(msg.data)
    ]
    if not data:
        raise LossInputError("forward_backward with no data: send at least one Datum")
    return FwdBwdRequest(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def model_input_tokens(model_input: dict, where: str = "prompt") -> list[int]:
    """A JSON ``ModelInput`` ({"chunks": [{"type": "encoded_text", "tokens": [...]}, ...]}) -> token ids."""
    tokens: list[int] = []
    for chunk in model_input.get("chunks", []):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise LossInputError(f"{where}: chunk of type '{chunk.get('type')}': this service takes token chunks")
        tokens.extend(int(t) for t in chunk.get("tokens", []))
    if not tokens:
        raise LossInputError(f"{where}: empty model input")
    return tokens


def encode_forward_backward(outputs: list[dict[str, torch.Tensor]], metrics: dict[str, float]) -> bytes:
    """Per-datum float32 vectors (``logprobs``, ...) and metrics -> a ``ForwardBackwardOutput`` protobuf."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    record = msg.loss_fn_outputs.add()
    record.type_tag, record.num_datums = "ArrayRecord", len(outputs)
    for name in outputs[0] if outputs else []:
        arrays = [o[name].detach().to(torch.float32).cpu().numpy().reshape(-1) for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        field = record.fields[name]
        field.data, field.offsets = b"".join(a.tobytes() for a in arrays), offsets.tobytes()
        field.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


def encode_sample(sequences: list[tuple[list[int], list[float] | None, str]], prompt_logprobs: list | None) -> bytes:
    """Sampled sequences (tokens, their logprobs, "stop" | "length") -> a ``SampleResponse`` protobuf."""
    pb = _pb()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    msg = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = reasons[reason]
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        if logprobs is not None:
            seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return msg.SerializeToString()
