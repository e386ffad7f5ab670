//! `miles bench gemm`: the model's matrix products at a number of rows (the rollout engine's
//! decode batch, a training micro-batch), each timed through cuBLAS's own pick
//! (`cublasGemmEx`, what the trainer and the engine call through `Gpu::gemm`) and through
//! every algorithm cuBLASLt's heuristic offers for the shape, with the weights' bytes per
//! second and whether each output has the same bits as cuBLAS's; at decode rows (at most 128)
//! also, on Hopper, through miles' own warpgroup-MMA product (`Gpu::decode_product`) in a few
//! tilings, and the gate/up product ending in its SwiGLU against cuBLAS's product then
//! `swiglu_rows`. Every time is the best of several replays of a CUDA graph of `--reps`
//! products, so the host's launch cost is not in it; the products cycle through enough copies
//! of the weight (at least 128 MiB of them) that each reads its weight from device memory, as a
//! decode step does, not from the 50 MB L2.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use anyhow::bail;
use clap::Args;
use half::bf16;
use miles_core::device::{
    Device, Gemm, GemmAlgo, GemmOutput, Gpu, GpuElement, GpuSlice, Transpose,
};
use miles_core::model::LlamaConfig;
use miles_core::ops::gpu::{DECODE_PRODUCT_MAX_ROWS, DECODE_PRODUCT_SWIGLU_COLUMNS, ProductOut};
use miles_core::{BackupPolicy, Buffer, DeviceChoice, ManagerSettings, MemoryManager, MemoryTag};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::model_cmd::parse_preset;
use crate::settings_args::BadSettings;

/// `miles bench gemm`.
#[derive(Args, Debug, Clone)]
pub struct GemmBenchArgs {
    /// Preset config whose products are timed: tiny, small, 0.5b, 1b or 3b.
    #[arg(long, default_value = "1b", value_parser = parse_preset)]
    pub preset: LlamaConfig,
    /// Rows of the activations (tokens per product), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [128, 4096])]
    pub rows: Vec<usize>,
    /// cuBLASLt candidates asked of its heuristic per shape.
    #[arg(long, default_value_t = 16)]
    pub candidates: usize,
    /// Products in one timed graph.
    #[arg(long, default_value_t = 50)]
    pub reps: usize,
    /// Timed replays of each graph; the best counts.
    #[arg(long, default_value_t = 5)]
    pub replays: usize,
}

/// One product of the model: `y (rows, out) = x (rows, inp) W^T (+ y)`; `swiglu`: the MLP's
/// gate/up product, which the decode step follows with SwiGLU.
struct Product {
    name: &'static str,
    out: usize,
    inp: usize,
    accumulate: bool,
    fp32_out: bool,
    swiglu: bool,
}

fn products(c: &LlamaConfig) -> [Product; 5] {
    let (h, f) = (c.hidden_size, c.intermediate_size);
    let p = |name, out, inp, accumulate, fp32_out| Product {
        name,
        out,
        inp,
        accumulate,
        fp32_out,
        swiglu: false,
    };
    [
        p("qkv", c.q_dim() + 2 * c.kv_dim(), h, false, false),
        p("o (+= x)", h, c.q_dim(), true, false),
        Product {
            swiglu: true,
            ..p("gate/up", 2 * f, h, false, false)
        },
        p("down (+= x)", h, f, true, false),
        p("lm head (fp32)", c.vocab_size, h, false, true),
    ]
}

/// Device memory for the operands: one region of a memory manager of its own, freed when both
/// are dropped.
struct Arena {
    buffers: Vec<Buffer>,
    memory: MemoryManager,
}

impl Arena {
    fn new(device: Arc<dyn Device>, bytes: usize) -> anyhow::Result<Arena> {
        let settings = ManagerSettings {
            margin_bytes: 0,
            disk: None,
        };
        let memory = MemoryManager::new(device, settings)?;
        memory.create_region(Self::tag(), BackupPolicy::None, bytes)?;
        Ok(Arena {
            buffers: Vec::new(),
            memory,
        })
    }

    fn tag() -> MemoryTag {
        MemoryTag::Named("bench-gemm".to_string())
    }

    fn take<T: GpuElement>(&mut self, len: usize) -> anyhow::Result<GpuSlice<T>> {
        let buffer = self.memory.alloc(&Self::tag(), len * size_of::<T>())?;
        let slice = GpuSlice::of(buffer.range())?;
        self.buffers.push(buffer);
        Ok(slice)
    }
}

/// `len` values drawn uniformly from `[-scale, scale)` with `seed`, as bf16.
fn values(seed: u64, len: usize, scale: f32) -> Vec<bf16> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len)
        .map(|_| bf16::from_f32(rng.random_range(-scale..scale)))
        .collect()
}

/// How the product is queued: cuBLAS's own pick ([`Gpu::gemm`]), a cuBLASLt algorithm, or
/// miles' decode product ([`Gpu::decode_product`]) in blocks of `block` columns, its output
/// bf16 (`slices` 0) or fp32 slices along k; or, for the gate/up product, followed by SwiGLU:
/// cuBLAS's bf16 product then [`Gpu::swiglu_rows`], or miles' product ending in it
/// ([`ProductOut::Swiglu`]).
#[derive(Clone, Copy)]
enum Route<'a> {
    Blas,
    Lt(&'a GemmAlgo),
    Wgmma { block: usize, slices: usize },
    Swiglu { own: bool },
}

/// The decode product's tilings timed for a product: bf16 out where cuBLAS writes bf16 and
/// does not add, fp32 slices where it adds (the decode step sums them with the residual) or
/// writes fp32.
fn tilings(p: &Product) -> &'static [(usize, usize)] {
    match (p.accumulate, p.fp32_out) {
        (false, false) => &[(128, 0), (64, 0)],
        (true, _) => &[(64, 4), (64, 2), (128, 4), (64, 8)],
        (false, true) => &[(128, 1), (64, 1)],
    }
}

/// Bytes of weight copies the timed products cycle through: more than the H200's L2.
const COLD_BYTES: usize = 128 << 20;

struct Operands<C> {
    y: GpuSlice<C>,
    /// The decode product's outputs: bf16, or up to 8 fp32 slices.
    narrow: GpuSlice<bf16>,
    wide: GpuSlice<f32>,
    /// SwiGLU's output, half of y's columns.
    half: GpuSlice<bf16>,
    x: GpuSlice<bf16>,
    /// Copies of one weight; the output check uses the first.
    w: Vec<GpuSlice<bf16>>,
    start: Vec<C>,
}

impl<C: GemmOutput + Default + PartialEq> Operands<C> {
    fn queue(
        &self,
        gpu: &Gpu,
        g: Gemm,
        route: Route<'_>,
        copy: usize,
    ) -> Result<(), miles_core::DeviceError> {
        let w = self.w[copy % self.w.len()];
        match route {
            Route::Blas => gpu.gemm(g, self.y, self.x, w),
            Route::Lt(algo) => gpu.gemm_with(g, algo, self.y, self.x, w),
            Route::Wgmma { block, slices } => {
                let out = if slices == 0 {
                    ProductOut::Bf16(self.narrow)
                } else {
                    ProductOut::Partials(self.wide.sub(0, slices * g.m * g.n)?)
                };
                gpu.decode_product(out, self.x, w, g.k, block)
            }
            Route::Swiglu { own: false } => {
                gpu.gemm(g, self.narrow, self.x, w)?;
                gpu.swiglu_rows(self.half, self.narrow, g.n / 2)
            }
            Route::Swiglu { own: true } => gpu.decode_product(
                ProductOut::Swiglu(self.half),
                self.x,
                w,
                g.k,
                DECODE_PRODUCT_SWIGLU_COLUMNS,
            ),
        }
    }

    /// The output of one product from the fixed starting `y`.
    fn output(&self, gpu: &Gpu, g: Gemm, route: Route<'_>) -> anyhow::Result<Vec<C>> {
        gpu.upload(self.y, &self.start)?;
        self.queue(gpu, g, route, 0)?;
        let mut out = vec![C::default(); self.y.len()];
        gpu.download(&mut out, self.y)?;
        Ok(out)
    }

    /// Seconds of one product: the best replay of a graph of `reps` of them.
    fn seconds(
        &self,
        gpu: &Gpu,
        g: Gemm,
        route: Route<'_>,
        args: &GemmBenchArgs,
    ) -> anyhow::Result<f64> {
        let graph =
            gpu.capture(|| (0..args.reps).try_for_each(|i| self.queue(gpu, g, route, i)))?;
        gpu.replay(&graph)?;
        gpu.synchronize()?;
        let mut best = f64::INFINITY;
        for _ in 0..args.replays {
            let start = Instant::now();
            gpu.replay(&graph)?;
            gpu.synchronize()?;
            best = best.min(start.elapsed().as_secs_f64() / args.reps as f64);
        }
        Ok(best)
    }
}

/// Runs the bench and prints a table per shape.
///
/// # Errors
/// [`BadSettings`] for empty rows or counts; no GPU; a failed product.
pub fn run(args: &GemmBenchArgs) -> anyhow::Result<()> {
    if args.rows.is_empty() || args.rows.contains(&0) {
        return Err(
            BadSettings("--rows takes positive row counts, e.g. --rows 128,4096".into()).into(),
        );
    }
    BadSettings::refuse_zero(&[
        ("--candidates", args.candidates),
        ("--reps", args.reps),
        ("--replays", args.replays),
    ])?;
    let Some(gpu) = crate::gpu::gpu_for(DeviceChoice::Cuda)? else {
        bail!("bench gemm runs on cuda and found no gpu");
    };
    let mut out = std::io::stdout().lock();
    for &rows in &args.rows {
        for p in products(&args.preset) {
            let report = if p.fp32_out {
                shape::<f32>(&gpu, &p, rows, args)?
            } else {
                shape::<bf16>(&gpu, &p, rows, args)?
            };
            write!(out, "{report}")?;
        }
    }
    Ok(())
}

/// The timings of one product at `rows`, as printed lines.
fn shape<C: GemmOutput + Default + PartialEq + OutputValue>(
    gpu: &Gpu,
    p: &Product,
    rows: usize,
    args: &GemmBenchArgs,
) -> anyhow::Result<String> {
    let mut g = Gemm::new(rows, p.out, p.inp, Transpose::No, Transpose::Yes);
    if p.accumulate {
        g = g.accumulate();
    }
    let weight_bytes = p.out * p.inp * 2;
    let copies = COLD_BYTES.div_ceil(weight_bytes).max(1);
    // y, the decode product's bf16 output, its up to 8 fp32 slices and SwiGLU's half of bf16.
    let out_bytes = size_of::<C>() + size_of::<bf16>() + 8 * size_of::<f32>() + 1;
    let bytes = rows * p.inp * 2 + copies * weight_bytes + rows * p.out * out_bytes;
    let device = Arc::clone(gpu.device()) as Arc<dyn Device>;
    let mut arena = Arena::new(device, bytes + (copies + 5) * 256)?;
    let ops = Operands {
        y: arena.take::<C>(rows * p.out)?,
        narrow: arena.take::<bf16>(rows * p.out)?,
        wide: arena.take::<f32>(8 * rows * p.out)?,
        half: arena.take::<bf16>(rows * p.out / 2)?,
        x: arena.take::<bf16>(rows * p.inp)?,
        w: (0..copies)
            .map(|_| arena.take::<bf16>(p.out * p.inp))
            .collect::<anyhow::Result<_>>()?,
        start: values(3, rows * p.out, 1.0)
            .into_iter()
            .map(|v| C::from_f32(v.to_f32()))
            .collect(),
    };
    gpu.upload(ops.x, &values(1, rows * p.inp, 1.0))?;
    let weight = values(2, p.out * p.inp, 0.02);
    for &w in &ops.w {
        gpu.upload(w, &weight)?;
    }
    let weight_gb = (p.out * p.inp * 2) as f64 / 1e9;
    let flops = 2.0 * (rows * p.out * p.inp) as f64;
    let reference = ops.output(gpu, g, Route::Blas)?;
    let blas = ops.seconds(gpu, g, Route::Blas, args)?;
    let mut lines = format!(
        "bench gemm: {} rows {rows}, (out {}, in {}): cublas (what miles runs) {:.1} us ({:.0} GB/s of weights, {:.0} TFLOP/s)\n",
        p.name,
        p.out,
        p.inp,
        blas * 1e6,
        weight_gb / blas,
        flops / blas / 1e12,
    );
    for (i, algo) in gpu
        .gemm_algorithms(g, ops.y, ops.x, ops.w[0], args.candidates)?
        .iter()
        .enumerate()
    {
        let same = ops.output(gpu, g, Route::Lt(algo))? == reference;
        let t = ops.seconds(gpu, g, Route::Lt(algo), args)?;
        lines += &format!(
            "  lt #{i:<2} {:>8.1} us  {:>5.2}x cublas  {:>5.0} GB/s  waves {:>5.2}  {} bits as cublas  [{}]\n",
            t * 1e6,
            blas / t,
            weight_gb / t,
            algo.waves(),
            if same { "same" } else { "other" },
            algo.describe()
        );
    }
    if rows <= DECODE_PRODUCT_MAX_ROWS && gpu.has_decode_product() {
        for &(block, slices) in tilings(p) {
            let route = Route::Wgmma { block, slices };
            ops.queue(gpu, g, route, 0)?;
            // Its output against cuBLAS's where both are the whole product.
            let error = if p.accumulate {
                String::from("(slices not compared)")
            } else {
                let got: Vec<f32> = if slices == 0 {
                    gpu_values(gpu, ops.narrow)?
                } else {
                    gpu_values(gpu, ops.wide.sub(0, rows * p.out)?)?
                };
                let scale = reference
                    .iter()
                    .map(|v| v.to_f32().abs())
                    .fold(0.0, f32::max);
                let worst = got
                    .iter()
                    .zip(&reference)
                    .map(|(a, b)| (a - b.to_f32()).abs())
                    .fold(0.0, f32::max);
                format!("largest difference from cublas {worst:.1e} of {scale:.1e}")
            };
            let t = ops.seconds(gpu, g, route, args)?;
            let out = if slices == 0 {
                "bf16 out".to_string()
            } else {
                format!("{slices} fp32 slices")
            };
            lines += &format!(
                "  wgmma    {:>8.1} us  {:>5.2}x cublas  {:>5.0} GB/s  blocks of {block} columns, {out}; {error}\n",
                t * 1e6,
                blas / t,
                weight_gb / t,
            );
        }
        if p.swiglu {
            lines += &swiglu_line(gpu, g, &ops, args)?;
        }
    }
    Ok(lines)
}

/// The gate/up product followed by SwiGLU, as the decode step runs it: cuBLAS's product then
/// `swiglu_rows`, against miles' product ending in its SwiGLU, and whether their outputs have
/// the same bits.
fn swiglu_line<C: GemmOutput + Default + PartialEq>(
    gpu: &Gpu,
    g: Gemm,
    ops: &Operands<C>,
    args: &GemmBenchArgs,
) -> anyhow::Result<String> {
    let (apart, fused) = (Route::Swiglu { own: false }, Route::Swiglu { own: true });
    ops.queue(gpu, g, apart, 0)?;
    let want = gpu_values(gpu, ops.half)?;
    ops.queue(gpu, g, fused, 0)?;
    let got = gpu_values(gpu, ops.half)?;
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    let (t_apart, t_fused) = (
        ops.seconds(gpu, g, apart, args)?,
        ops.seconds(gpu, g, fused, args)?,
    );
    Ok(format!(
        "  swiglu   {:>8.1} us  {:>5.2}x cublas + swiglu_rows ({:.1} us)  blocks of {DECODE_PRODUCT_SWIGLU_COLUMNS} columns, SwiGLU out; largest difference from cublas + swiglu_rows {worst:.1e}\n",
        t_fused * 1e6,
        t_apart / t_fused,
        t_apart * 1e6,
    ))
}

/// The values of `slice` as f32.
fn gpu_values<T: GpuElement + Default + OutputValue>(
    gpu: &Gpu,
    slice: GpuSlice<T>,
) -> anyhow::Result<Vec<f32>> {
    let mut out = vec![T::default(); slice.len()];
    gpu.download(&mut out, slice)?;
    Ok(out.into_iter().map(OutputValue::to_f32).collect())
}

/// The outputs' values to and from fp32.
trait OutputValue {
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl OutputValue for f32 {
    fn from_f32(v: f32) -> f32 {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl OutputValue for bf16 {
    fn from_f32(v: f32) -> bf16 {
        bf16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: GemmBenchArgs,
    }

    fn refusal(flags: &[&str]) -> String {
        let cli =
            Cli::try_parse_from(std::iter::once("gemm").chain(flags.iter().copied())).unwrap();
        let error = run(&cli.args).unwrap_err();
        assert!(error.downcast_ref::<BadSettings>().is_some(), "{error:#}");
        error.to_string()
    }

    #[test]
    fn the_arena_hands_out_disjoint_aligned_slices_of_its_region() {
        let device: Arc<dyn Device> = Arc::new(miles_core::CpuDevice::new(64 << 20));
        let mut arena = Arena::new(device, 3 * 256 + 1000).unwrap();
        let a = arena.take::<bf16>(100).unwrap();
        let b = arena.take::<f32>(50).unwrap();
        assert_eq!((a.len(), b.len()), (100, 50));
        assert!(a.address().is_multiple_of(256) && b.address().is_multiple_of(256));
        assert!(b.address() >= a.address() + a.bytes() as u64);
        assert!(arena.take::<f32>(1 << 20).is_err(), "past the region");
    }

    #[test]
    fn bench_gemm_refuses_zero_rows_and_counts_before_looking_for_a_gpu() {
        assert!(refusal(&["--rows", "128,0"]).contains("--rows"));
        assert!(refusal(&["--reps", "0"]).contains("--reps"));
        assert!(refusal(&["--candidates", "0"]).contains("--candidates"));
    }
}
