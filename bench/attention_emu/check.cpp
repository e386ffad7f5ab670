// Runs the attention kernels on the CPU (cuda_on_cpu.hpp) for one shape and compares them with
// a float64 reference on the same bf16 inputs:
//   check flash B T H KH D     training's forward, dq and dk/dv (every split of the group)
//   check paged B T H KH D P   the engine's paged attention over B sequences of T positions in
//                              blocks of P (every token), and the decode step of each
//                              sequence's last position (its key and value stored on the way)
// It launches the kernels as ops/gpu/flash.rs and ops/gpu/paged.rs do: keep them in step.
#include <algorithm>
#include <random>
#include <utility>

#define PICK(name) (DP == 16 ? name##_16 : DP == 32 ? name##_32 : DP == 64 ? name##_64 : name##_128)

// Random bf16 inputs of (B, T, H, D) queries and output gradients, (B, T, KH, D) keys and values.
struct Inputs {
    int B, T, H, KH, D;
    std::vector<bf16> q, k, v, dout;
    size_t at(int b, int t, int heads, int h) const { return (((size_t)b * T + t) * heads + h) * D; }
};

static Inputs random_inputs(int B, int T, int H, int KH, int D) {
    Inputs in{B, T, H, KH, D};
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const size_t nq = (size_t)B * T * H * D, nk = (size_t)B * T * KH * D;
    for (auto [x, n, spread] : {std::tuple{&in.q, nq, 1.5f}, {&in.k, nk, 1.5f}, {&in.v, nk, 1.0f},
                                {&in.dout, nq, 1.0f}}) {
        x->resize(n);
        for (auto& e : *x) e = f2bf(nd(rng) * spread);
    }
    return in;
}

// Causal attention and its gradients in float64: out, dq (B, T, H, D), dk, dv (B, T, KH, D), and
// each row's log-sum-exp in base 2 (B, H, T).
struct Reference {
    std::vector<double> out, dq, dk, dv, lse;
};

static Reference float64_attention(const Inputs& in) {
    const int B = in.B, T = in.T, H = in.H, KH = in.KH, D = in.D, G = H / KH;
    const double scale = 1.0 / sqrt((double)D);
    Reference r{std::vector<double>(in.q.size()), std::vector<double>(in.q.size()),
                std::vector<double>(in.k.size()), std::vector<double>(in.k.size()),
                std::vector<double>((size_t)B * H * T)};
    auto x = [](const std::vector<bf16>& a, size_t i) { return (double)bf2f(a[i]); };
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const int kh = h / G;
            for (int i = 0; i < T; i++) {
                const size_t qi = in.at(b, i, H, h);
                std::vector<double> s(i + 1), p(i + 1);
                double mx = -1e300;
                for (int j = 0; j <= i; j++) {
                    double a = 0;
                    for (int d = 0; d < D; d++) a += x(in.q, qi + d) * x(in.k, in.at(b, j, KH, kh) + d);
                    s[j] = a * scale;
                    mx = std::max(mx, s[j]);
                }
                double sum = 0;
                for (int j = 0; j <= i; j++) sum += (p[j] = exp(s[j] - mx));
                for (int j = 0; j <= i; j++) p[j] /= sum;
                r.lse[((size_t)b * H + h) * T + i] = (mx + log(sum)) / log(2.0);
                double delta = 0;
                for (int d = 0; d < D; d++) {
                    double o = 0;
                    for (int j = 0; j <= i; j++) o += p[j] * x(in.v, in.at(b, j, KH, kh) + d);
                    r.out[qi + d] = o;
                    delta += o * x(in.dout, qi + d);
                }
                for (int j = 0; j <= i; j++) {
                    const size_t kj = in.at(b, j, KH, kh);
                    double a = 0;
                    for (int d = 0; d < D; d++) a += x(in.dout, qi + d) * x(in.v, kj + d);
                    const double ds = p[j] * (a - delta);
                    for (int d = 0; d < D; d++) {
                        r.dq[qi + d] += ds * x(in.k, kj + d) * scale;
                        r.dk[kj + d] += ds * x(in.q, qi + d) * scale;
                        r.dv[kj + d] += p[j] * x(in.dout, qi + d);
                    }
                }
            }
        }
    return r;
}

// Whether `got` is within 2% of `want`'s largest value everywhere (printing the worst).
static bool close(const char* what, const std::vector<bf16>& got, const std::vector<double>& want) {
    double err = 0, big = 0;
    for (size_t i = 0; i < got.size(); i++) {
        const double g = bf2f(got[i]);
        err = std::isfinite(g) ? std::max(err, fabs(g - want[i])) : INFINITY;
        big = std::max(big, fabs(want[i]));
    }
    const double relative = big > 0 ? err / big : err;
    printf("%s: max error %.3g of max %.3g (%.2g relative)\n", what, err, big, relative);
    return relative < 0.02;
}

// A checksum of the bits, to compare two kernels' runs.
static unsigned long long checksum(std::initializer_list<const std::vector<bf16>*> arrays) {
    unsigned long long h = 1469598103934665603ull;
    for (auto* a : arrays)
        for (bf16 x : *a) h = (h ^ x) * 1099511628211ull;
    return h;
}

static bool check_flash(const Inputs& in, const Reference& want) {
    const int B = in.B, T = in.T, H = in.H, KH = in.KH, D = in.D;
    const int DP = D <= 16 ? 16 : D <= 32 ? 32 : D <= 64 ? 64 : 128;
    const size_t nq = in.q.size(), nk = in.k.size(), rows = (size_t)B * H * T;
    const bf16 *q = in.q.data(), *k = in.k.data(), *v = in.v.data(), *dout = in.dout.data();
    std::vector<bf16> out(nq, 0xffff), dq(nq, 0xffff), dk(nk, 0xffff), dv(nk, 0xffff);
    std::vector<float> lse(rows, NAN), delta(rows, NAN);
    const float scale = 1.0f / sqrtf((float)D), scale_log2 = scale * 1.4426950408889634f;
    const size_t tile = 64 * (DP + 8) * 2;
    const unsigned tiles = (T + 63) / 64;
    auto fwd = PICK(flash_forward);
    const unsigned rows_a_block = DP <= 64 ? 128 : 64;  // Forward<DP>::ROWS
    launch({(T + rows_a_block - 1) / rows_a_block, (unsigned)H, (unsigned)B}, 128, (4 + rows_a_block / 64) * tile,
           [&] { fwd(out.data(), lse.data(), q, k, v, T, H, KH, D, scale_log2); });
    auto bdq = PICK(flash_backward_dq);
    launch({tiles, (unsigned)H, (unsigned)B}, 128, 6 * tile + 512, [&] {
        bdq(dq.data(), delta.data(), q, k, v, out.data(), dout, lse.data(), T, H, KH, D, scale_log2, scale);
    });
    double lerr = 0;
    for (size_t i = 0; i < rows; i++)
        lerr = std::max(lerr, std::isfinite(lse[i]) ? fabs(lse[i] - want.lse[i]) : INFINITY);
    printf("lse: max error %.3g\n", lerr);
    bool ok = lerr < 1e-3;
    ok &= close("out", out, want.out);
    ok &= close("dq", dq, want.dq);
    // dk and dv with the query group in every number of pieces that divides it (flash.rs's
    // dkv_split picks one by the grid's size); the last split's go into the checksum.
    auto bdkv = PICK(flash_backward_dkv);
    for (int split = 1; split <= H / KH; split++) {
        if ((H / KH) % split) continue;
        std::fill(dk.begin(), dk.end(), 0xffff);
        std::fill(dv.begin(), dv.end(), 0xffff);
        std::vector<float> part(2 * nq, NAN);
        launch({(tiles + 1) / 2, (unsigned)(KH * split), (unsigned)B}, 128, 6 * tile + 1024, [&] {
            bdkv(dk.data(), dv.data(), part.data(), split, q, k, v, dout, lse.data(), delta.data(), T, H, KH, D,
                 scale_log2, scale);
        });
        if (split > 1) {
            launch({4, 1, 1}, 128, 0,
                   [&] { flash_dkv_reduce(dk.data(), dv.data(), part.data(), split, (long long)nk); });
        }
        char name[2][32];
        snprintf(name[0], 32, "dk (%d pieces)", split);
        snprintf(name[1], 32, "dv (%d pieces)", split);
        ok &= close(name[0], dk, want.dk);
        ok &= close(name[1], dv, want.dv);
    }
    printf("%s bits %016llx\n", ok ? "PASS" : "FAIL", checksum({&out, &dq, &dk, &dv}));
    return ok;
}

static bool check_paged(const Inputs& in, const Reference& want, int P) {
    const int B = in.B, T = in.T, H = in.H, KH = in.KH, D = in.D;
    const int DP = D <= 16 ? 16 : D <= 32 ? 32 : D <= 64 ? 64 : 128;
    const int layers = 2, layer = 1, kv_dim = KH * D, per_seq = (T + P - 1) / P;
    const int num_blocks = B * per_seq + 3, chunks = (H / KH + 7) / 8;
    const float scale_log2 = 1.0f / sqrtf((float)D) * 1.4426950408889634f;
    const size_t shared = (16 + 2 * 64) * (DP + 8) * 2;
    // Each sequence's blocks, shuffled over the cache; everything else in it NaN, which a read of
    // a place no position holds would carry into the output.
    std::vector<unsigned> ids(num_blocks), tables((size_t)B * per_seq);
    for (int i = 0; i < num_blocks; i++) ids[i] = i;
    std::shuffle(ids.begin(), ids.end(), std::mt19937(11));
    for (size_t i = 0; i < tables.size(); i++) tables[i] = ids[i];
    std::vector<bf16> cache((size_t)num_blocks * layers * 2 * P * kv_dim, 0x7fc0);
    auto place = [&](int b, int t, int half) {
        const unsigned block = tables[(size_t)b * per_seq + t / P];
        return (((size_t)block * layers + layer) * 2 + half) * P * kv_dim + (size_t)(t % P) * kv_dim;
    };
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < KH; h++)
                for (int d = 0; d < D; d++) {
                    cache[place(b, t, 0) + h * D + d] = in.k[in.at(b, t, KH, h) + d];
                    cache[place(b, t, 1) + h * D + d] = in.v[in.at(b, t, KH, h) + d];
                }
    // Every token of every sequence at once, as a prefill does.
    const long long n = (long long)B * T;
    std::vector<unsigned> seq_rows(n), positions(n);
    for (long long i = 0; i < n; i++) seq_rows[i] = (unsigned)(i / T), positions[i] = (unsigned)(i % T);
    std::vector<bf16> out(in.q.size(), 0xffff);
    auto attend = PICK(paged_attention);
    const long long per_block = 16 / std::min(8, H / KH);  // tokens a block, as paged.rs
    launch({(unsigned)((n + per_block - 1) / per_block), (unsigned)KH, (unsigned)chunks}, 128, shared, [&] {
        attend(out.data(), in.q.data(), cache.data(), tables.data(), seq_rows.data(), positions.data(), n, H, KH, D,
               layer, layers, P, per_seq, scale_log2);
    });
    bool ok = close("paged attention out", out, want.out);
    // A decode step: each sequence's last position, its key and value not yet in the cache (NaN
    // there), its q/k/v as the fused product's rows (no biases or norms, rotary by angle 0).
    std::vector<unsigned> last(B), rows(B), slots(B);
    std::vector<bf16> qkv((size_t)B * (H + 2 * KH) * D);
    for (int b = 0; b < B; b++) {
        last[b] = T - 1, rows[b] = b;
        slots[b] = tables[(size_t)b * per_seq + (T - 1) / P] * P + (T - 1) % P;
        for (int half = 0; half < 2; half++)
            std::fill_n(cache.begin() + place(b, T - 1, half), kv_dim, (bf16)0x7fc0);
        bf16* row = qkv.data() + (size_t)b * (H + 2 * KH) * D;
        std::copy_n(in.q.begin() + in.at(b, T - 1, H, 0), H * D, row);
        std::copy_n(in.k.begin() + in.at(b, T - 1, KH, 0), KH * D, row + H * D);
        std::copy_n(in.v.begin() + in.at(b, T - 1, KH, 0), KH * D, row + (H + KH) * D);
    }
    std::vector<float> cos_t((size_t)T * D / 2, 1.0f), sin_t((size_t)T * D / 2, 0.0f);
    std::vector<bf16> step(in.q.size() / T, 0xffff);
    auto decode = PICK(paged_decode);
    launch({(unsigned)B, (unsigned)KH, (unsigned)chunks}, 128, shared, [&] {
        decode(step.data(), cache.data(), qkv.data(), nullptr, nullptr, nullptr, cos_t.data(), sin_t.data(),
               slots.data(), tables.data(), rows.data(), last.data(), B, H, KH, D, 1e-5f, layer, layers, P, per_seq,
               num_blocks, scale_log2);
    });
    std::vector<double> want_step(step.size());
    std::vector<bf16> stored(2 * (size_t)B * kv_dim), want_stored(stored.size());
    for (int b = 0; b < B; b++) {
        std::copy_n(want.out.begin() + in.at(b, T - 1, H, 0), H * D, want_step.begin() + (size_t)b * H * D);
        for (int half = 0; half < 2; half++) {
            std::copy_n(cache.begin() + place(b, T - 1, half), kv_dim, stored.begin() + (2 * b + half) * kv_dim);
            std::copy_n((half ? in.v : in.k).begin() + in.at(b, T - 1, KH, 0), kv_dim,
                        want_stored.begin() + (2 * b + half) * kv_dim);
        }
    }
    ok &= close("paged decode out", step, want_step);
    const bool kept = stored == want_stored;
    printf("paged decode: the new keys and values %s\n", kept ? "stored" : "NOT stored as given");
    ok &= kept;
    printf("%s bits %016llx\n", ok ? "PASS" : "FAIL", checksum({&out, &step}));
    return ok;
}

int main(int argc, char** argv) {
    const std::string mode = argc > 6 ? argv[1] : "";
    if (mode != "flash" && mode != "paged") {
        fprintf(stderr, "usage: check flash B T H KH D | check paged B T H KH D P\n");
        return 2;
    }
    const Inputs in = random_inputs(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), atoi(argv[6]));
    const Reference want = float64_attention(in);
    const bool ok = mode == "flash" ? check_flash(in, want) : check_paged(in, want, argc > 7 ? atoi(argv[7]) : 16);
    return ok ? 0 : 1;
}
