//! Wrappers of the paged KV cache kernels (`kernels/paged.cu`): a layer's queries made ready and
//! its new keys and values written through a block table (one kernel after the fused q/k/v
//! product), attention over a sequence's cached positions for prefill and decode alike, and
//! both in one kernel for a pass of one token a sequence (a decode step).
//!
//! The cache is bf16, laid out `(blocks, L, 2, P, K*D)`: a block holds `P` positions of every
//! layer's keys (half 0) and values (half 1), so a sequence's position `t` lives in block
//! `table[t / P]` at slot `t % P`, and a block is one contiguous run (copy-on-write is one
//! [`Gpu::copy`]). [`PagedCache`] does the arithmetic.

use half::bf16;

use super::elementwise::as_i32;
use crate::device::DeviceError;
use crate::device::{Gpu, GpuSlice, LaunchConfig};

/// The kernels of `kernels/paged.cu`: the attention for each of [`PADDED`], the decode
/// attention for each, then the q/k/v kernel.
pub(super) const KERNELS: [&str; 9] = [
    "paged_attention_16",
    "paged_attention_32",
    "paged_attention_64",
    "paged_attention_128",
    "paged_decode_16",
    "paged_decode_32",
    "paged_decode_64",
    "paged_decode_128",
    "qkv_rotary_cache",
];

/// The head dims the attention kernel is built for, each an instance padding smaller dims with
/// zeros.
const PADDED: [usize; 4] = [16, 32, 64, 128];

/// Largest head dim [`Gpu::paged_attention`] takes (`PAGED_MAX_D` in the kernel).
pub const PAGED_MAX_HEAD_DIM: usize = 128;

/// Warps per block of both kernels (`PAGED_WARPS` in the kernels).
const WARPS: usize = 4;

/// Query heads one attention block serves (`PAGED_HEADS` in the kernel).
const ATTENTION_HEADS: usize = 8;

/// Query rows of an attention block's products (an mma.sync tile's 16).
const ATTENTION_ROWS: usize = 16;

/// Positions of one attention tile (`PAGED_TILE` in the kernel).
const ATTENTION_TILE: usize = 64;

/// Dynamic shared memory of the attention kernels' instance for head dims up to `padded`: the
/// queries (16 rows), a tile of keys and one of values, bf16 rows of `padded + 8`.
fn attention_shared_bytes(padded: usize) -> u32 {
    ((ATTENTION_ROWS + 2 * ATTENTION_TILE) * (padded + 8) * 2) as u32
}

/// The shape of a paged KV cache: `(blocks, L, 2, P, K*D)` bf16 elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedCache {
    /// Blocks in the cache.
    pub num_blocks: usize,
    /// `L`: layers.
    pub num_layers: usize,
    /// `P`: positions per block.
    pub block_size: usize,
    /// `K`: key/value heads.
    pub kv_heads: usize,
    /// `D`: channels per head.
    pub head_dim: usize,
}

impl PagedCache {
    /// `K*D`: channels of one position's key (or value).
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Elements of one block.
    pub fn block_elems(&self) -> usize {
        self.num_layers * 2 * self.block_size * self.kv_dim()
    }

    /// Elements of the whole cache.
    pub fn elems(&self) -> usize {
        self.num_blocks * self.block_elems()
    }

    /// The first element of `layer`'s key (`half` 0) or value (`half` 1) at `slot` of `block`.
    pub fn offset(&self, block: usize, layer: usize, half: usize, slot: usize) -> usize {
        ((block * self.num_layers + layer) * 2 + half) * self.block_size * self.kv_dim()
            + slot * self.kv_dim()
    }

    /// The slot index the kernels take for position `pos` held by `block`: `block * P + pos % P`.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] when it does not fit 32 bits (a cache of more than
    /// `u32::MAX` positions).
    pub fn slot(&self, block: usize, pos: usize) -> Result<u32, DeviceError> {
        let slot = block * self.block_size + pos % self.block_size;
        u32::try_from(slot).map_err(|_| DeviceError::ShapeMismatch {
            what: "paged cache slot",
            expected: u32::MAX as usize,
            actual: slot,
        })
    }

    fn check(&self, cache: &GpuSlice<bf16>, layer: usize) -> Result<(), DeviceError> {
        cache.expect_len("paged cache", self.elems())?;
        if layer >= self.num_layers {
            return Err(DeviceError::ShapeMismatch {
                what: "paged cache layer",
                expected: self.num_layers,
                actual: layer,
            });
        }
        if self.block_size == 0 || self.kv_dim() == 0 {
            return Err(DeviceError::ShapeMismatch {
                what: "paged cache block size and kv dim",
                expected: 1,
                actual: 0,
            });
        }
        Ok(())
    }
}

/// The new tokens of one step and where their sequences' blocks are, as the attention kernel
/// reads them (all on the device, filled by the caller).
#[derive(Clone, Copy, Debug)]
pub struct PagedTokens {
    /// `(N)`: each token's position in its sequence; it attends to positions `0..=p`, all
    /// already written to the cache.
    pub positions: GpuSlice<u32>,
    /// `(N)`: each token's row of `tables`.
    pub seq_rows: GpuSlice<u32>,
    /// `(S, max_blocks)`: each sequence's block table; entries past its length are unused.
    pub tables: GpuSlice<u32>,
    /// Blocks per row of `tables`.
    pub max_blocks: usize,
}

/// A layer's fused q/k/v product and what turns it into queries, keys and values.
#[derive(Clone, Copy, Debug)]
pub struct QkvHeads {
    /// `(N, (H + 2K) * D)`: each token's query heads, then key heads, then value heads.
    pub qkv: GpuSlice<bf16>,
    /// `H`: query heads.
    pub heads: usize,
    /// `((H + 2K) * D)`: the q, k and v biases, in the families that have them.
    pub bias: Option<GpuSlice<bf16>>,
    /// `(D)`: the per-head query norm's weights, in the families that have them.
    pub q_norm: Option<GpuSlice<bf16>>,
    /// `(D)`: the per-head key norm's weights, with `q_norm`.
    pub k_norm: Option<GpuSlice<bf16>>,
    /// The norms' epsilon.
    pub eps: f32,
}

/// Where a pass's tokens go: their positions (with the rotary tables they index) and their
/// cache slots.
#[derive(Clone, Copy, Debug)]
pub struct TokenPlaces {
    /// `(N)`: each token's position in its sequence.
    pub positions: GpuSlice<u32>,
    /// `(N)`: each token's cache slot ([`PagedCache::slot`]).
    pub slots: GpuSlice<u32>,
    /// `(P_max, D/2)`: the rotary cosines.
    pub cos: GpuSlice<f32>,
    /// `(P_max, D/2)`: the rotary sines.
    pub sin: GpuSlice<f32>,
}

impl Gpu {
    /// Makes `layer`'s queries ready and stores its keys and values from the fused product
    /// `heads.qkv (N, (H + 2K) * D)`, whose rows hold the `H` query heads, then the `K` key
    /// heads, then the `K` value heads: adds the biases, normalises each query and key head by
    /// its RMS times its norm weights (where the family has them), turns queries and keys by
    /// each token's position, writes the queries into `q (N, H*D)` and the keys and values at
    /// `at.slots (N)` (see [`PagedCache::slot`]) of `cache`. Each step rounds to bf16 as the
    /// separate bias, norm and rotary kernels do. A slot past the cache is skipped on the
    /// device.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`]; the launch's error.
    pub fn qkv_rotary_cache(
        &self,
        q: GpuSlice<bf16>,
        cache: GpuSlice<bf16>,
        shape: &PagedCache,
        layer: usize,
        heads: &QkvHeads,
        at: &TokenPlaces,
    ) -> Result<(), DeviceError> {
        shape.check(&cache, layer)?;
        let (n, d, kv) = (at.slots.len(), shape.head_dim, shape.kv_heads);
        check_heads(heads, at, shape, n)?;
        q.expect_len("prepared queries", n * heads.heads * d)?;
        if n == 0 {
            return Ok(());
        }
        let items = n * (heads.heads + kv);
        let config = LaunchConfig {
            grid_dim: (items.div_ceil(WARPS) as u32, 1, 1),
            block_dim: (32 * WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = (
            n as i64,
            as_i32("heads", heads.heads)?,
            as_i32("kv heads", kv)?,
            as_i32("head dim", d)?,
            heads.eps,
            as_i32("layer", layer)?,
            as_i32("layers", shape.num_layers)?,
            as_i32("block size", shape.block_size)?,
            shape.num_blocks as i64,
        );
        let (bias, q_norm, k_norm) = extras(heads);
        self.launch(
            "qkv_rotary_cache",
            config,
            &[
                &q.address(),
                &cache.address(),
                &heads.qkv.address(),
                &bias,
                &q_norm,
                &k_norm,
                &at.positions.address(),
                &at.cos.address(),
                &at.sin.address(),
                &at.slots.address(),
                &args.0,
                &args.1,
                &args.2,
                &args.3,
                &args.4,
                &args.5,
                &args.6,
                &args.7,
                &args.8,
            ],
        )
    }

    /// Causal attention of the new tokens' queries `q (N, H*D)` over their sequences' cached
    /// keys and values of `layer`, into `out (N, H*D)`: token `i` at position `p` attends to
    /// positions `0..=p` of its sequence, query head `h` to kv head `h / (H / K)`, scores scaled
    /// by `1/sqrt(D)`, softmax in fp32, the products on the tensor cores (fp32 sums, the
    /// probabilities rounded to bf16 for the second, as in training's attention). Serves
    /// prefill (many tokens of a sequence) and decode (one token each) alike; every position
    /// read must have been written first. `H` is `q`'s length over `N*D`.
    ///
    /// Block tables and positions are trusted to lie inside the cache (the engine's bookkeeping
    /// builds them).
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] for mismatched shapes, `H` not a multiple of `K`, a head
    /// dim over [`PAGED_MAX_HEAD_DIM`] or not a multiple of 8, or a cache or queries not
    /// 16-byte aligned; the launch's error.
    pub fn paged_attention(
        &self,
        out: GpuSlice<bf16>,
        q: GpuSlice<bf16>,
        cache: GpuSlice<bf16>,
        shape: &PagedCache,
        layer: usize,
        tokens: &PagedTokens,
    ) -> Result<(), DeviceError> {
        let n = tokens.positions.len();
        let d = shape.head_dim;
        if n == 0 {
            return shape.check(&cache, layer);
        }
        let heads = q.len() / (n * d).max(1);
        if heads == 0 || heads * n * d != q.len() || !heads.is_multiple_of(shape.kv_heads) {
            return Err(DeviceError::ShapeMismatch {
                what: "paged attention queries (N tokens of a multiple of the kv heads)",
                expected: n * shape.kv_dim(),
                actual: q.len(),
            });
        }
        aligned("paged attention queries (16-byte aligned)", q.address())?;
        // A block takes the consecutive tokens whose query heads of one kv head fill the 16
        // rows of its products.
        let per_block = ATTENTION_ROWS / (heads / shape.kv_heads).clamp(1, ATTENTION_HEADS);
        let (instance, config) =
            attention_launch(out, cache, shape, layer, tokens, (heads, per_block))?;
        let a = AttentionArgs::new(shape, layer, tokens, heads)?;
        self.launch(
            KERNELS[instance],
            config,
            &[
                &out.address(),
                &q.address(),
                &cache.address(),
                &tokens.tables.address(),
                &tokens.seq_rows.address(),
                &tokens.positions.address(),
                &a.n,
                &a.heads,
                &a.kv_heads,
                &a.d,
                &a.layer,
                &a.layers,
                &a.block_size,
                &a.max_blocks,
                &a.scale_log2,
            ],
        )
    }

    /// [`Gpu::qkv_rotary_cache`] and [`Gpu::paged_attention`] in one kernel, for a pass of
    /// one token each of distinct sequences (a decode step; padding rows may share a slot no
    /// sequence reads), each token's slot the place its block table gives its position:
    /// each block makes its token's queries, key and value ready from `heads.qkv` as
    /// `qkv_rotary_cache` does, stores the key and value at the token's slot and attends over
    /// the cached positions before it and the new one, without the queries' round trip through
    /// memory or a second launch. The output and the cache are bit for bit those of the two
    /// kernels (for a slot past the cache, which is skipped, the token attends over the key and
    /// value it would have stored). `(at, tokens)` are the arguments of the two; the positions are
    /// `tokens.positions`, which `at.positions` must be.
    ///
    /// # Errors
    /// As the two kernels, and [`DeviceError::ShapeMismatch`] when `at` and `tokens` hold
    /// different positions.
    pub fn paged_decode_attention(
        &self,
        out: GpuSlice<bf16>,
        cache: GpuSlice<bf16>,
        shape: &PagedCache,
        layer: usize,
        heads: &QkvHeads,
        (at, tokens): (&TokenPlaces, &PagedTokens),
    ) -> Result<(), DeviceError> {
        let n = tokens.positions.len();
        if at.positions.address() != tokens.positions.address() || at.positions.len() != n {
            return Err(DeviceError::ShapeMismatch {
                what: "decode attention positions (the same for the cache writes and the attention)",
                expected: n,
                actual: at.positions.len(),
            });
        }
        check_heads(heads, at, shape, n)?;
        if n == 0 {
            return shape.check(&cache, layer);
        }
        // The rows and the rotary tables' rows are copied 16 bytes at a time.
        for (what, address) in [
            (
                "decode attention q/k/v rows (16-byte aligned)",
                heads.qkv.address(),
            ),
            (
                "decode attention rotary tables (16-byte aligned)",
                at.cos.address(),
            ),
            (
                "decode attention rotary tables (16-byte aligned)",
                at.sin.address(),
            ),
        ] {
            aligned(what, address)?;
        }
        let (instance, config) =
            attention_launch(out, cache, shape, layer, tokens, (heads.heads, 1))?;
        let a = AttentionArgs::new(shape, layer, tokens, heads.heads)?;
        let (bias, q_norm, k_norm) = extras(heads);
        self.launch(
            KERNELS[PADDED.len() + instance],
            config,
            &[
                &out.address(),
                &cache.address(),
                &heads.qkv.address(),
                &bias,
                &q_norm,
                &k_norm,
                &at.cos.address(),
                &at.sin.address(),
                &at.slots.address(),
                &tokens.tables.address(),
                &tokens.seq_rows.address(),
                &tokens.positions.address(),
                &a.n,
                &a.heads,
                &a.kv_heads,
                &a.d,
                &heads.eps,
                &a.layer,
                &a.layers,
                &a.block_size,
                &a.max_blocks,
                &(shape.num_blocks as i64),
                &a.scale_log2,
            ],
        )
    }
}

/// Checks the fused q/k/v rows of `n` tokens, their biases and norms, and the places they go.
fn check_heads(
    heads: &QkvHeads,
    at: &TokenPlaces,
    shape: &PagedCache,
    n: usize,
) -> Result<(), DeviceError> {
    let (d, kv) = (shape.head_dim, shape.kv_heads);
    let width = (heads.heads + 2 * kv) * d;
    heads.qkv.expect_len("fused q/k/v rows", n * width)?;
    at.positions.expect_len("token positions", n)?;
    at.slots.expect_len("token slots", n)?;
    if let Some(bias) = heads.bias {
        bias.expect_len("q/k/v biases", width)?;
    }
    for norm in [heads.q_norm, heads.k_norm].into_iter().flatten() {
        norm.expect_len("q/k norm weights", d)?;
    }
    if d > PAGED_MAX_HEAD_DIM || !d.is_multiple_of(2) || at.cos.len() != at.sin.len() {
        return Err(DeviceError::ShapeMismatch {
            what: "q/k/v heads (an even head dim, at most the largest) and rotary tables",
            expected: PAGED_MAX_HEAD_DIM,
            actual: d,
        });
    }
    Ok(())
}

/// [`DeviceError::ShapeMismatch`] naming `what` unless `address` is 16-byte aligned.
fn aligned(what: &'static str, address: u64) -> Result<(), DeviceError> {
    if address.is_multiple_of(16) {
        return Ok(());
    }
    Err(DeviceError::ShapeMismatch {
        what,
        expected: 16,
        actual: (address % 16) as usize,
    })
}

/// The device addresses of the biases and the q and k norms, 0 where the family has none.
fn extras(heads: &QkvHeads) -> (u64, u64, u64) {
    let address = |slice: Option<GpuSlice<bf16>>| slice.map_or(0, |s| s.address());
    (
        address(heads.bias),
        address(heads.q_norm),
        address(heads.k_norm),
    )
}

/// A launch grid's y or z side of `n` blocks: CUDA takes at most 65,535 there.
pub(super) fn grid_side(what: &'static str, n: usize) -> Result<u32, DeviceError> {
    const MOST: usize = 65_535;
    if n > MOST {
        return Err(DeviceError::ShapeMismatch {
            what,
            expected: MOST,
            actual: n,
        });
    }
    Ok(n as u32)
}

/// Checks an attention launch over `tokens` (at least one) with `heads` query heads, `per_block`
/// tokens a block, and picks its instance: the smallest padded head dim holding the model's, and
/// its launch shape.
fn attention_launch(
    out: GpuSlice<bf16>,
    cache: GpuSlice<bf16>,
    shape: &PagedCache,
    layer: usize,
    tokens: &PagedTokens,
    (heads, per_block): (usize, usize),
) -> Result<(usize, LaunchConfig), DeviceError> {
    shape.check(&cache, layer)?;
    let (n, d) = (tokens.positions.len(), shape.head_dim);
    if d > PAGED_MAX_HEAD_DIM || !d.is_multiple_of(8) {
        return Err(DeviceError::ShapeMismatch {
            what: "paged attention head dim (a multiple of 8, at most the largest)",
            expected: PAGED_MAX_HEAD_DIM,
            actual: d,
        });
    }
    if heads == 0 || !heads.is_multiple_of(shape.kv_heads) {
        return Err(DeviceError::ShapeMismatch {
            what: "paged attention query heads (a multiple of the kv heads)",
            expected: shape.kv_heads,
            actual: heads,
        });
    }
    out.expect_len("paged attention output", n * heads * d)?;
    // The tiles are copied 16 bytes at a time.
    aligned("paged attention cache (16-byte aligned)", cache.address())?;
    tokens
        .seq_rows
        .expect_len("paged attention sequence rows", n)?;
    if tokens.max_blocks == 0 || !tokens.tables.len().is_multiple_of(tokens.max_blocks) {
        return Err(DeviceError::ShapeMismatch {
            what: "paged attention block tables",
            expected: tokens.max_blocks,
            actual: tokens.tables.len(),
        });
    }
    // One block a run of `per_block` tokens, kv head and chunk of its query heads (x, y, z).
    let chunks = (heads / shape.kv_heads).div_ceil(ATTENTION_HEADS);
    // The smallest instance that holds `d` (d is at most the largest, checked above).
    let instance = PADDED
        .iter()
        .position(|&p| d <= p)
        .unwrap_or(PADDED.len() - 1);
    let config = LaunchConfig {
        grid_dim: (
            as_i32("attention tokens", n.div_ceil(per_block))? as u32,
            grid_side("attention kv heads", shape.kv_heads)?,
            grid_side("attention query head chunks", chunks)?,
        ),
        block_dim: (32 * WARPS as u32, 1, 1),
        shared_mem_bytes: attention_shared_bytes(PADDED[instance]),
    };
    Ok((instance, config))
}

/// The attention kernels' scalar arguments, in the kernels' names.
struct AttentionArgs {
    n: i64,
    heads: i32,
    kv_heads: i32,
    d: i32,
    layer: i32,
    layers: i32,
    block_size: i32,
    max_blocks: i32,
    scale_log2: f32,
}

impl AttentionArgs {
    fn new(
        shape: &PagedCache,
        layer: usize,
        tokens: &PagedTokens,
        heads: usize,
    ) -> Result<Self, DeviceError> {
        Ok(Self {
            n: tokens.positions.len() as i64,
            heads: as_i32("heads", heads)?,
            kv_heads: as_i32("kv heads", shape.kv_heads)?,
            d: as_i32("head dim", shape.head_dim)?,
            layer: as_i32("layer", layer)?,
            layers: as_i32("layers", shape.num_layers)?,
            block_size: as_i32("block size", shape.block_size)?,
            max_blocks: as_i32("max blocks", tokens.max_blocks)?,
            // The kernels' softmax is in base 2.
            scale_log2: std::f32::consts::LOG2_E / (shape.head_dim as f32).sqrt(),
        })
    }
}
