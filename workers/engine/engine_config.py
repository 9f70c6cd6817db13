"""EngineConfig: every setting of one engine, built once at the edge (CLI) and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdrouter.common.flags import flag
from workers.engine.host_policy import WRITE_POLICIES

DTYPES = ("float32", "float16", "bfloat16")
ENGINE_BACKENDS = ("auto", "paddle", "torch")
DECODE_ATTENTION = ("sdpa", "triton")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. max_model_len None means: the model's max_position_embeddings,
    capped so that one sequence always fits the KV pool (num_kv_blocks * block_size)."""

    model: str = field(
        default="tiny",
        metadata=flag(
            "--model",
            "'tiny' (built-in test model), 'demo' (packaged trained model) or a Hugging "
            "Face checkpoint folder",
        ),
    )
    dtype: str = field(
        default="float32", metadata=flag("--dtype", "weights and KV cache dtype", choices=DTYPES)
    )
    seed: int = field(
        default=0,
        metadata=flag("--seed", "seed of the built-in tiny model's weights (not of sampling)"),
    )
    block_size: int = field(default=16, metadata=flag("--block-size", "tokens per KV block"))
    num_kv_blocks: int = field(
        default=1024, metadata=flag("--num-kv-blocks", "KV blocks in the cache")
    )
    max_num_seqs: int = field(
        default=64, metadata=flag("--max-num-seqs", "most requests in one running batch")
    )
    max_num_batched_tokens: int = field(
        default=1024,
        metadata=flag(
            "--max-num-batched-tokens",
            "most tokens computed in one engine step (prefill chunk budget)",
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=flag(
            "--max-model-len",
            "context length: prompt + completion tokens (default: the model's, "
            "capped by the KV cache)",
        ),
    )
    device: str = field(default="cpu", metadata=flag("--device", "'cpu' or 'gpu' / 'gpu:N'"))
    # workers/engine/runner_factory.py resolves auto and builds the runner.
    engine_backend: str = field(
        default="auto",
        metadata=flag(
            "--engine-backend",
            "the model runner's framework: paddle, torch (PyTorch; the GPU hosts' usual "
            "install) or auto (a GPU --device: paddle where paddlepaddle-gpu is installed, "
            "else torch where it sees the GPU; --device cpu: paddle, torch where Paddle is "
            "not installed)",
            choices=ENGINE_BACKENDS,
        ),
    )
    cuda_graphs: bool = field(
        default=False,
        metadata=flag(
            "--cuda-graphs",
            "torch backend on a GPU: replay plain decode steps as CUDA graphs, one per "
            "(batch, context) bucket, captured at a bucket's first step",
        ),
    )
    decode_attention: str = field(
        default="sdpa",
        metadata=flag(
            "--decode-attention",
            "torch backend: how decode steps attend: sdpa (gather each sequence's blocks, then "
            "PyTorch's fused attention) or triton (a paged kernel reading the blocks in place; "
            "--block-size >= 16)",
            choices=DECODE_ATTENTION,
        ),
    )
    cache_dir: str | None = field(
        default=None,
        metadata=flag(
            "--model-cache-dir",
            "where built-in tiny checkpoints are materialized (default: ~/.cache/pdrouter)",
        ),
    )
    # Off, the block pool is a plain FIFO allocator (workers/engine/prefix_cache.py).
    enable_prefix_cache: bool = field(
        default=True,
        metadata=flag(
            "--no-prefix-cache",
            "turn the device prefix cache off: every prompt block is "
            "computed (the reference for correctness tests and benchmarks)",
            negate=True,
        ),
    )

    # The host tier between the device cache and the pool (workers/engine/host_tier.py).
    swap_space_gib: float = field(
        default=0.0,
        metadata=flag(
            "--swap-space",
            "GiB of host memory for KV blocks between the device prefix cache and the pool "
            "(page-locked on a GPU); 0 turns the host tier off",
        ),
    )
    write_policy: str = field(
        default="write_through_selective",
        metadata=flag(
            "--write-policy",
            "when a device block is copied to the host tier: as soon as it is complete "
            "(write_through), once served --write-through-threshold times "
            "(write_through_selective) or when the device evicts it (write_back)",
            choices=WRITE_POLICIES,
        ),
    )
    write_through_threshold: int = field(
        default=2,
        metadata=flag(
            "--write-through-threshold",
            "write_through_selective: device hits before a block is copied to the host tier",
        ),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=flag(
            "--tensor-parallel-size",
            "ranks (processes) the model is split over, by KV heads and MLP columns; rank 0 "
            "serves HTTP and schedules (workers/engine/tp/)",
            aliases=("-tp",),
        ),
    )
    # workers/engine/grammar_compiler.py: a schema past either is a 400 naming it.
    grammar_max_schema_bytes: int = field(
        default=65536,
        metadata=flag(
            "--grammar-max-schema-bytes",
            "largest JSON schema (response_format or a forced tool's parameters, as compact "
            "JSON) compiled into a grammar; larger: 400",
        ),
    )
    grammar_compile_timeout_s: float = field(
        default=5.0,
        metadata=flag(
            "--grammar-compile-timeout-s",
            "time budget of one schema's grammar compile (in a child process, killed at it); "
            "past it: 400, and the same schema is refused at once after",
        ),
    )

    def __post_init__(self) -> None:
        if self.swap_space_gib < 0 or self.write_through_threshold < 1:
            raise ValueError(
                f"--swap-space ({self.swap_space_gib}) must be >= 0 and "
                f"--write-through-threshold ({self.write_through_threshold}) >= 1"
            )
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"--write-policy must be one of {', '.join(WRITE_POLICIES)}")
        if self.swap_space_gib > 0 and not self.enable_prefix_cache:
            raise ValueError("--swap-space needs the device prefix cache (not --no-prefix-cache)")
        for name in (
            "block_size",
            "num_kv_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "tensor_parallel_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.grammar_max_schema_bytes < 1 or not self.grammar_compile_timeout_s > 0:
            raise ValueError(
                "--grammar-max-schema-bytes must be >= 1 and --grammar-compile-timeout-s > 0"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.engine_backend not in ENGINE_BACKENDS:
            raise ValueError(
                f"EngineConfig.engine_backend must be one of {', '.join(ENGINE_BACKENDS)}, "
                f"got {self.engine_backend!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(
                f"EngineConfig.dtype must be float32, float16 or bfloat16, got {self.dtype!r}"
            )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def resolved_max_model_len(self, max_position_embeddings: int) -> int:
        """The max_model_len to run with for a model of max_position_embeddings positions."""
        cap = min(max_position_embeddings, self.kv_capacity_tokens)
        if self.max_model_len is None:
            return cap
        if self.max_model_len > cap:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds what this engine can hold: the "
                f"model has {max_position_embeddings} positions and the KV pool "
                f"{self.num_kv_blocks} blocks x {self.block_size} = {self.kv_capacity_tokens} "
                "tokens"
            )
        return self.max_model_len
