// Runs the flash kernels (forward, dq, dk/dv) on the CPU (cuda_on_cpu.hpp) for one shape and
// compares them with a float64 reference on the same bf16 inputs. Usage: check B T H KH D. It
// launches the kernels as ops/gpu/flash.rs does: keep the two in step.
#include <random>
int main(int argc, char** argv) {
    const int B = atoi(argv[1]), T = atoi(argv[2]), H = atoi(argv[3]), KH = atoi(argv[4]), D = atoi(argv[5]);
    const int DP = D <= 16 ? 16 : D <= 32 ? 32 : D <= 64 ? 64 : 128;
    const size_t nq = (size_t)B * T * H * D, nk = (size_t)B * T * KH * D, rows = (size_t)B * H * T;
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<bf16> q(nq), k(nk), v(nk), dout(nq);
    for (auto& x : q) x = f2bf(nd(rng) * 1.5f);
    for (auto& x : k) x = f2bf(nd(rng) * 1.5f);
    for (auto& x : v) x = f2bf(nd(rng));
    for (auto& x : dout) x = f2bf(nd(rng));
    std::vector<bf16> out(nq, 0xffff), dq(nq, 0xffff), dk(nk, 0xffff), dv(nk, 0xffff);
    std::vector<float> lse(rows, NAN), delta(rows, NAN);
    const float scale = 1.0f / sqrtf((float)D), scale_log2 = scale * 1.4426950408889634f;
    const size_t tile = 64 * (DP + 8) * 2;
    const unsigned tiles = (T + 63) / 64;
    const int threads = 128;
#define PICK(name) (DP == 16 ? name##_16 : DP == 32 ? name##_32 : DP == 64 ? name##_64 : name##_128)
    auto fwd = PICK(flash_forward);
    const unsigned rows_a_block = DP <= 64 ? 128 : 64;  // Forward<DP>::ROWS
    launch({(T + rows_a_block - 1) / rows_a_block, (unsigned)H, (unsigned)B}, threads, (4 + rows_a_block / 64) * tile, [&] {
        fwd(out.data(), lse.data(), q.data(), k.data(), v.data(), T, H, KH, D, scale_log2);
    });
    auto bdq = PICK(flash_backward_dq);
    launch({tiles, (unsigned)H, (unsigned)B}, threads, 6 * tile + 512, [&] {
        bdq(dq.data(), delta.data(), q.data(), k.data(), v.data(), out.data(), dout.data(), lse.data(), T, H, KH, D,
            scale_log2, scale);
    });
    // dk and dv with the query group in every number of pieces that divides it (flash.rs's
    // dkv_split picks one by the grid's size); the last split's are kept for the checksum.
    auto bdkv = PICK(flash_backward_dkv);
    std::vector<std::pair<int, std::vector<bf16>>> dks, dvs;
    for (int split = 1; split <= H / KH; split++) {
        if ((H / KH) % split) continue;
        std::fill(dk.begin(), dk.end(), 0xffff);
        std::fill(dv.begin(), dv.end(), 0xffff);
        std::vector<float> part(2 * nq, NAN);
        launch({(tiles + 1) / 2, (unsigned)(KH * split), (unsigned)B}, threads, 6 * tile + 1024, [&] {
            bdkv(dk.data(), dv.data(), part.data(), split, q.data(), k.data(), v.data(), dout.data(), lse.data(),
                 delta.data(), T, H, KH, D, scale_log2, scale);
        });
        if (split > 1) {
            launch({4, 1, 1}, 128, 0, [&] {
                flash_dkv_reduce(dk.data(), dv.data(), part.data(), split, (long long)nk);
            });
        }
        dks.emplace_back(split, dk);
        dvs.emplace_back(split, dv);
    }
    // float64 reference.
    const int G = H / KH;
    std::vector<double> ro(nq, 0), rdq(nq, 0), rdk(nk, 0), rdv(nk, 0), rlse(rows, 0);
    auto Q = [&](int b, int t, int h, int d) { return (double)bf2f(q[(((size_t)b * T + t) * H + h) * D + d]); };
    auto K = [&](int b, int t, int h, int d) { return (double)bf2f(k[(((size_t)b * T + t) * KH + h) * D + d]); };
    auto V = [&](int b, int t, int h, int d) { return (double)bf2f(v[(((size_t)b * T + t) * KH + h) * D + d]); };
    auto DO = [&](int b, int t, int h, int d) { return (double)bf2f(dout[(((size_t)b * T + t) * H + h) * D + d]); };
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const int kh = h / G;
            for (int i = 0; i < T; i++) {
                std::vector<double> s(i + 1), p(i + 1), dp(i + 1);
                double mx = -1e300;
                for (int j = 0; j <= i; j++) {
                    double a = 0;
                    for (int d = 0; d < D; d++) a += Q(b, i, h, d) * K(b, j, kh, d);
                    s[j] = a * scale;
                    mx = std::max(mx, s[j]);
                }
                double sum = 0;
                for (int j = 0; j <= i; j++) sum += (p[j] = exp(s[j] - mx));
                for (int j = 0; j <= i; j++) p[j] /= sum;
                rlse[((size_t)b * H + h) * T + i] = (mx + log(sum)) / log(2.0);
                double dl = 0;
                for (int d = 0; d < D; d++) {
                    double o = 0;
                    for (int j = 0; j <= i; j++) o += p[j] * V(b, j, kh, d);
                    ro[(((size_t)b * T + i) * H + h) * D + d] = o;
                    dl += o * DO(b, i, h, d);
                }
                for (int j = 0; j <= i; j++) {
                    double a = 0;
                    for (int d = 0; d < D; d++) a += DO(b, i, h, d) * V(b, j, kh, d);
                    const double ds = p[j] * (a - dl);
                    for (int d = 0; d < D; d++) {
                        rdq[(((size_t)b * T + i) * H + h) * D + d] += ds * K(b, j, kh, d) * scale;
                        rdk[(((size_t)b * T + j) * KH + kh) * D + d] += ds * Q(b, i, h, d) * scale;
                        rdv[(((size_t)b * T + j) * KH + kh) * D + d] += p[j] * DO(b, i, h, d);
                    }
                }
            }
        }
    auto cmp = [](const char* what, const std::vector<bf16>& got, const std::vector<double>& want) {
        double err = 0, big = 0;
        for (size_t i = 0; i < got.size(); i++) {
            const double g = bf2f(got[i]);
            err = std::isfinite(g) ? std::max(err, fabs(g - want[i])) : INFINITY;
            big = std::max(big, fabs(want[i]));
        }
        const double relative = big > 0 ? err / big : err;
        printf("%s: max error %.3g of max %.3g (%.2g relative)\n", what, err, big, relative);
        return relative < 0.02;
    };
    double lerr = 0;
    for (size_t i = 0; i < rows; i++) lerr = std::max(lerr, std::isfinite(lse[i]) ? fabs(lse[i] - rlse[i]) : INFINITY);
    printf("lse: max error %.3g\n", lerr);
    bool ok = lerr < 1e-3;
    ok &= cmp("out", out, ro);
    ok &= cmp("dq", dq, rdq);
    for (size_t i = 0; i < dks.size(); i++) {
        char name[2][32];
        snprintf(name[0], 32, "dk (%d pieces)", dks[i].first);
        snprintf(name[1], 32, "dv (%d pieces)", dvs[i].first);
        ok &= cmp(name[0], dks[i].second, rdk);
        ok &= cmp(name[1], dvs[i].second, rdv);
    }
    // A checksum of the bits, to compare two kernels' runs.
    unsigned long long h = 1469598103934665603ull;
    for (auto* a : {&out, &dq, &dk, &dv})
        for (bf16 x : *a) h = (h ^ x) * 1099511628211ull;
    printf("%s bits %016llx\n", ok ? "PASS" : "FAIL", h);
    return ok ? 0 : 1;
}
