"""DecodeGraphs: decode steps of the torch runner replayed as CUDA graphs, per shape bucket.

At small batches a decode step is launch-bound: some 30 kernels a layer, each a few
microseconds of Python and driver time against microseconds of GPU work. A CUDA graph
replays the whole step's kernels in one launch. Its shapes are fixed, so a step is padded
to its bucket (B rows, MB blocks per sequence):

    rows    [0, S)     the step's decodes, in its order
            [S, B)     padding: token 0 at position 0, its K/V written to the scratch block
                       (TorchKVCache.scratch_block, outside the pool's blocks), attending to
                       that block's first row alone
    blocks  [0, n_s)   sequence s's table (n_s of them); the rest point at the scratch block
            [n_s, MB)  and are masked out, as step_input.py masks a shorter table's padding

B: the smallest of BATCH_BUCKETS >= S; MB: the smallest power of two >= the longest table.
A bucket is captured at its first step (two warm-up runs on a side stream, then the capture,
every graph in one memory pool: steps never run concurrently), from then on replayed after
the step's inputs are copied into its static tensors. Only plain decode steps qualify (every
chunk one token, none asking for prompt logprobs, no sliding window); others run eagerly.
With capture=False (the CPU) the padded tensors run eagerly: how the tests check the padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from workers.engine.step_input import StepInput, head_rows
from workers.engine.torch_kv_cache import TorchKVCache
from workers.engine.torch_model import GroupTensors, StepTensors, TorchLlamaDecoder
from workers.engine.torch_runtime import torch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


@dataclass
class _Bucket:
    inputs: StepTensors  # static: filled before each replay
    graph: Any  # torch.cuda.CUDAGraph, None when not captured
    out: torch.Tensor | None  # float32 [B, vocab]: the captured run's output


class DecodeGraphs:
    """Runs plain decode steps of `decoder` over `cache` through per-bucket CUDA graphs."""

    def __init__(
        self,
        decoder: TorchLlamaDecoder,
        cache: TorchKVCache,
        capture: bool = True,
    ) -> None:
        self.decoder, self.cache, self.capture = decoder, cache, capture
        self.max_batch = BATCH_BUCKETS[-1]  # larger batches run eagerly
        self.device = decoder.device
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def fits(self, step: StepInput) -> bool:
        """A plain decode step of at most max_batch sequences (one group of one token each,
        one logits row per sequence) of a model without a sliding window."""
        return (
            len(step.groups) == 1
            and step.groups[0].query_len == 1
            and 0 < step.num_tokens <= self.max_batch
            and len(step.logits_rows) == step.num_tokens
            and self.decoder.config.sliding_window is None
        )

    def run(self, step: StepInput) -> torch.Tensor:
        """float32 logits [len(step.logits_rows), vocab] of a step that fits()."""
        self.decoder.check_positions(step)
        group = step.groups[0]
        num_seqs = step.num_tokens
        batch = next(b for b in BATCH_BUCKETS if b >= num_seqs)
        max_blocks = 1 << max(0, int(group.block_table.shape[1]) - 1).bit_length()
        key = (batch, max_blocks)
        if key not in self.buckets:
            self.buckets[key] = self._capture(batch, max_blocks)
        bucket = self.buckets[key]
        self._fill(bucket.inputs, step, batch, max_blocks)
        if bucket.graph is not None:
            with torch.cuda.device(self.device):  # the engine thread's current device may differ
                bucket.graph.replay()
            out = bucket.out
        else:
            out = self.decoder.run_tensors(bucket.inputs, self.cache.with_scratch)
        assert out is not None
        return out.index_select(0, self._upload(step.logits_rows))

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def _padded(self, step: StepInput | None, batch: int, max_blocks: int) -> dict[str, np.ndarray]:
        """The bucket's inputs as numpy: the step's rows first, padding after (all padding
        when step is None: what the warm-up and capture runs see)."""
        c, bs = self.decoder.config, self.cache.block_size
        scratch = self.cache.scratch_block
        num_seqs = 0 if step is None else step.num_tokens
        arrays = {
            "token_ids": np.zeros(batch, np.int64),
            "positions": np.zeros(batch, np.int64),
            "write_blocks": np.full(batch, scratch, np.int64),
            "write_rows": np.zeros(batch, np.int64),
        }
        table = np.full((batch, max_blocks), scratch, np.int64)
        allowed = np.zeros((batch, max_blocks * bs), bool)
        allowed[num_seqs:, 0] = True  # padding attends to the scratch block's first row
        if step is not None:
            arrays["token_ids"][:num_seqs] = step.token_ids
            arrays["positions"][:num_seqs] = step.positions
            arrays["write_blocks"][:num_seqs] = step.write_block_ids
            arrays["write_rows"][:num_seqs] = step.write_rows
            group = step.groups[0]
            used = group.block_table.shape[1]
            table[:num_seqs, :used] = group.block_table
            allowed[:num_seqs, : used * bs] = group.allowed[:, 0, :]
        arrays["gather_ids"] = head_rows(table, c.num_kv_heads)
        arrays["mask"] = allowed.reshape(batch, 1, 1, max_blocks * bs)
        # The paged kernel's view of the same: padding reads the scratch block's first row.
        arrays["block_tables"] = table
        arrays["context_lens"] = np.ones(batch, np.int32)
        arrays["context_lens"][:num_seqs] = arrays["positions"][:num_seqs] + 1
        return arrays

    def _fill(self, inputs: StepTensors, step: StepInput, batch: int, max_blocks: int) -> None:
        arrays = self._padded(step, batch, max_blocks)
        group = inputs.groups[0]
        targets = {
            "token_ids": inputs.token_ids,
            "positions": inputs.positions,
            "write_blocks": inputs.write_blocks,
            "write_rows": inputs.write_rows,
            "gather_ids": group.gather_ids,
            "mask": group.mask,
            "block_tables": group.block_tables,
            "context_lens": group.context_lens,
        }
        for name, target in targets.items():
            if target is not None:  # the masked path's inputs, or the paged path's
                target.copy_(torch.from_numpy(arrays[name]))

    def _capture(self, batch: int, max_blocks: int) -> _Bucket:
        arrays = {k: self._upload(v) for k, v in self._padded(None, batch, max_blocks).items()}
        ctx = max_blocks * self.cache.block_size
        if self.decoder.paged_decode:
            group = GroupTensors(
                0,
                batch,
                1,
                "paged",
                ctx,
                None,
                None,
                arrays["block_tables"],
                arrays["context_lens"],
            )
        else:
            group = GroupTensors(0, batch, 1, "masked", ctx, arrays["gather_ids"], arrays["mask"])
        inputs = StepTensors(
            token_ids=arrays["token_ids"],
            positions=arrays["positions"],
            write_blocks=arrays["write_blocks"],
            write_rows=arrays["write_rows"],
            groups=(group,),
            logits_rows=self._upload(np.arange(batch, dtype=np.int64)),
        )
        if not self.capture:
            return _Bucket(inputs, None, None)
        with torch.cuda.device(self.device):  # the capture's own streams are the current device's
            return self._capture_on_device(inputs)

    def _capture_on_device(self, inputs: StepTensors) -> _Bucket:
        caches = self.cache.with_scratch
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialization happens outside the capture
                self.decoder.run_tensors(inputs, caches)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the handoff's threads keep using CUDA (their own streams) meanwhile.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self.decoder.run_tensors(inputs, caches)
        return _Bucket(inputs, graph, out)
