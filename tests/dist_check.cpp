// voodoo-dist-check DEVICE: one rank of a process group's self-check (issue #17), started under torchrun's variables
// (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) by tests/test_dist.cpp (Gloo, CPU, two processes) and on
// the GPU machine (NCCL, one process a GPU: scripts/device-run.sh's stage nccl). DEVICE is cpu or cuda (then
// cuda:LOCAL_RANK). Every rank checks what every collective gave against the values it must give, exactly: the sums
// are of small integers, exact in f32 and bf16 in any order. Prints one line and exits 0 when all hold, else names
// the first that failed and exits 1.
#include "common/error.h"
#include "dist/dist.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <vector>

using namespace voodoo;

namespace {

int check(bool ok, const std::string & what, int rank) {
    if (!ok) {
        fmt::print(stderr, "voodoo-dist-check rank {}: {} is wrong\n", rank, what);
    }
    return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc != 2 || (std::string(argv[1]) != "cpu" && std::string(argv[1]) != "cuda")) {
        fmt::print(stderr, "usage: voodoo-dist-check cpu|cuda (under torchrun's variables)\n");
        return 2;
    }
    try {
        const std::optional<dist::launch_env> env = dist::launch_env_from_environment();
        const dist::launch_env e = env ? *env : dist::launch_env{};
        const torch::Device device = std::string(argv[1]) == "cuda"
                                         ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(e.local_rank))
                                         : torch::Device(torch::kCPU);
        dist::process_group pg(e, std::chrono::seconds(120), device);
        const int r = pg.rank(), n = pg.size();
        const auto on = torch::TensorOptions().device(device);
        int bad = 0;

        // Sum: rank r contributes (r + 1) · [1, 2, 3, 4] in f32 and bf16 and r in int64, in one call (two dtypes).
        std::vector<torch::Tensor> sums{torch::arange(1, 5, on.dtype(torch::kFloat)) * (r + 1),
                                        torch::arange(1, 5, on.dtype(torch::kBFloat16)) * (r + 1),
                                        torch::full({3}, r, on.dtype(torch::kLong))};
        pg.all_reduce_sum(sums);
        const double tri = n * (n + 1) / 2.0;  // Σ (r + 1)
        bad += check(torch::equal(sums[0].cpu(), torch::arange(1, 5, torch::kFloat) * tri), "the f32 sum", r);
        bad += check(torch::equal(sums[1].cpu(), torch::arange(1, 5, torch::kBFloat16) * tri), "the bf16 sum", r);
        bad += check(sums[1].scalar_type() == torch::kBFloat16 && sums[1].device() == device, "the bf16 sum's dtype", r);
        bad += check(torch::equal(sums[2].cpu(), torch::full({3}, int64_t(n) * (n - 1) / 2, torch::kLong)), "the int64 sum", r);

        // Max: rank r holds [r, −r]; the maximum is [n − 1, 0].
        torch::Tensor mx = torch::tensor({float(r), float(-r)}, on.dtype(torch::kFloat));
        pg.all_reduce_max(mx);
        bad += check(torch::equal(mx.cpu(), torch::tensor({float(n - 1), 0.0f})), "the maximum", r);

        // Point to point around a ring, two messages per pair received in the order sent (NCCL has no tags).
        if (n > 1) {
            const int next = (r + 1) % n, prev = (r + n - 1) % n;
            const torch::Tensor a = torch::full({5}, 10.0f * r, on), b = torch::full({2, 3}, 100.0f + r, on);
            torch::Tensor ga = torch::empty({5}, on), gb = torch::empty({2, 3}, on);
            if (r == 0) {  // rank 0 sends first, every other receives first: a chain, no cycle of waits with blocking sends
                pg.send(a, next, 1);
                pg.send(b, next, 2);
                pg.recv(ga, prev, 1);
                pg.recv(gb, prev, 2);
            } else {
                pg.recv(ga, prev, 1);
                pg.recv(gb, prev, 2);
                pg.send(a, next, 1);
                pg.send(b, next, 2);
            }
            bad += check(torch::equal(ga.cpu(), torch::full({5}, 10.0f * prev)), "the first message from the previous rank", r);
            bad += check(torch::equal(gb.cpu(), torch::full({2, 3}, 100.0f + prev)), "the second message", r);
        }
        pg.barrier();
        if (bad == 0) {
            fmt::print("voodoo-dist-check rank {} of {}: {} on {}: sums (f32, bf16, int64), maximum, send/recv, barrier ok\n",
                       r, n, pg.backend(), device.str());
        }
        return bad == 0 ? 0 : 1;
    } catch (const std::exception & ex) {
        fmt::print(stderr, "voodoo-dist-check: {}\n", ex.what());
        return 1;
    }
}
