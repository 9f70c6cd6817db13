// swap_cache_layout: move the KV chunks of a set of blocks between the worker's paged cache
// (on the GPU) and a block-major host buffer (mapped, page-locked host memory), in one launch.
//
// Worker cache, tensor j = 2 * layer + kv (kv 0 = K, 1 = V), each
//   [num_blocks, num_kv_heads, block_size, head_dim], C order:
//   cache_j[b, h, t, d] at  layer_addrs[j] + ((b * H + h) * BS + t) * D + d        (elements)
//
// Host buffer, one slot per moved block,
//   [num_slots, num_layers, 2, num_kv_heads, block_size, head_dim], C order:
//   host[s, l, kv, h, t, d] at host_addr + (((s * 2L + 2l + kv) * H + h) * BS + t) * D + d
//
// Both sides therefore hold one (layer, kv, block) "chunk" of C = H * BS * D elements
// contiguously:
//   device chunk (j, i) = cache_j + block_ids[i] * C
//   host   chunk (j, i) = host    + (host_slots[i] * 2L + j) * C
// and the kernel is a gather/scatter of num_items * 2L contiguous chunks.
//
// With a host side of more heads (kernels/layout.py HostHeads: a reader cutting its heads out
// of a larger shard) a host chunk is host_chunk_vecs long and the device chunk's bytes are
// the run at host_offset_vecs inside it:
//   host   chunk (j, i) = host + (host_slots[i] * 2L + j) * host_chunk + host_offset
// (host_chunk = C and host_offset = 0 otherwise).
//
// MODE 0: device -> host (host chunk = device chunk); MODE 1: host -> device.
//
// The host side is read/written by the SMs directly through the mapped address (zero-copy):
// one launch replaces 2L * num_items DMA calls, whose fixed per-call cost dominates at the
// 8 KiB - 256 KiB chunk sizes of real models. Vec is the widest access (16, 8, 4, 2 or 1
// bytes) that divides the chunk size and every base address, chosen by the launcher, so sizes
// that are not a multiple of 16 bytes are copied whole, never with a dropped tail.
//
// Work split: each chunk is cut into pieces of 32 * SWAP_UNROLL vectors (4 KiB at 16-byte
// vectors) and every warp walks the (item, tensor, piece) space with a grid stride. A warp
// keeps SWAP_UNROLL coalesced 512-byte requests in flight whatever the chunk size, so small
// chunks load the bus as well as large ones, and a grid capped far below the SM count (the
// copy shares the GPU with model compute) still covers any amount of work.

#define SWAP_UNROLL 8
#define SWAP_WARP 32

template <typename Vec, int MODE>
__global__ void __launch_bounds__(1024) swap_cache_layout_kernel(
    const unsigned long long* __restrict__ layer_addrs,  // [num_tensors]
    const long long* __restrict__ block_ids,             // [num_items]
    const long long* __restrict__ host_slots,            // [num_items]
    unsigned long long host_addr,                         // device-visible host address
    long long num_items,
    long long num_tensors,
    long long chunk_vecs,        // C * elem_bytes / sizeof(Vec)
    long long host_chunk_vecs,   // a host chunk's stride (chunk_vecs unless host heads)
    long long host_offset_vecs,  // the device chunk's start inside a host chunk
    long long pieces_per_chunk)  // ceil(chunk_vecs / (SWAP_WARP * SWAP_UNROLL))
{
    const int lane = threadIdx.x % SWAP_WARP;
    const long long warps_per_cta = blockDim.x / SWAP_WARP;
    const long long num_units = num_items * num_tensors * pieces_per_chunk;
    const long long stride = (long long)gridDim.x * warps_per_cta;
    for (long long unit = blockIdx.x * warps_per_cta + threadIdx.x / SWAP_WARP;
         unit < num_units; unit += stride) {
        const long long piece = unit % pieces_per_chunk;
        const long long chunk = unit / pieces_per_chunk;
        const long long j = chunk % num_tensors;
        const long long i = chunk / num_tensors;

        Vec* dev = reinterpret_cast<Vec*>(layer_addrs[j]) + block_ids[i] * chunk_vecs;
        Vec* host = reinterpret_cast<Vec*>(host_addr) + (host_slots[i] * num_tensors + j) * host_chunk_vecs
                    + host_offset_vecs;
        const Vec* __restrict__ src = MODE == 0 ? dev : host;
        Vec* __restrict__ dst = MODE == 0 ? host : dev;

        const long long first = piece * (SWAP_WARP * SWAP_UNROLL) + lane;
        // All loads first, then all stores: SWAP_UNROLL independent requests in flight per
        // lane hide the PCIe round trip of mapped host reads.
        Vec regs[SWAP_UNROLL];
#pragma unroll
        for (int k = 0; k < SWAP_UNROLL; ++k) {
            const long long v = first + k * SWAP_WARP;
            if (v < chunk_vecs) regs[k] = src[v];
        }
#pragma unroll
        for (int k = 0; k < SWAP_UNROLL; ++k) {
            const long long v = first + k * SWAP_WARP;
            if (v < chunk_vecs) dst[v] = regs[k];
        }
    }
}
