"""Conversions between pdspec.v1 messages and the engine's Python objects (one place for each)."""

from engine.block_manager import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from engine.params import SamplingParams
from engine.stats import AcceptanceStats
from proto.pdspec.v1 import common_pb2, kv_pb2


def sampling_params(options: common_pb2.SamplingOptions, speculation: common_pb2.SpeculationOptions | None = None) -> SamplingParams:
    """Raises pydantic.ValidationError naming the offending field (the API's field names)."""
    fields = {name: getattr(options, name) for name in ("max_tokens", "temperature", "top_p", "top_k", "seed")
              if options.HasField(name)}
    if speculation is not None and speculation.HasField("num_speculative_tokens"):
        fields["num_speculative_tokens"] = speculation.num_speculative_tokens
    return SamplingParams(stop=tuple(options.stop), stop_token_ids=tuple(options.stop_token_ids),
                          ignore_eos=options.ignore_eos, **fields)


def sampling_options(params: SamplingParams) -> common_pb2.SamplingOptions:
    return common_pb2.SamplingOptions(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                                      top_k=params.top_k, seed=params.seed, stop=list(params.stop),
                                      stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos)


def acceptance(stats: AcceptanceStats) -> common_pb2.Acceptance:
    d = stats.to_dict()
    return common_pb2.Acceptance(drafted=d["drafted"], accepted=d["accepted"], steps=d["steps"],
                                 mean_acceptance_length=d["mean_acceptance_length"],
                                 per_position_acceptance_rate=d["per_position_acceptance_rate"],
                                 accepted_per_position=d["accepted_per_position"])


def kv_event(event: KVEvent) -> kv_pb2.KVEvent:
    if isinstance(event, BlockStored):
        return kv_pb2.KVEvent(stored=kv_pb2.BlockStored(block_hashes=event.block_hashes, parent_hash=event.parent_hash))
    if isinstance(event, BlockRemoved):
        return kv_pb2.KVEvent(removed=kv_pb2.BlockRemoved(block_hashes=event.block_hashes))
    assert isinstance(event, AllBlocksCleared)
    return kv_pb2.KVEvent(cleared=kv_pb2.AllBlocksCleared())
