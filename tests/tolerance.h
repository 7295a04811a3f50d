// Rounding-error bounds for the tests' float comparisons: a bound follows from the computation it checks, so
// it holds for every summation order a BLAS kernel or vector width may pick (scripts/test-coretypes.sh).
// The rules are those of N. J. Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., SIAM 2002:
// the standard model fl(x op y) = (x op y)(1 + δ), |δ| ≤ u (§2.2), and for n products summed in any order,
// with or without FMA, |fl(Σ aᵢbᵢ) − Σ aᵢbᵢ| ≤ γ_n Σ |aᵢbᵢ| with γ_n = n·u / (1 − n·u) (§3.1, (3.4)–(3.5)).
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <sstream>

namespace voodoo::test {

/// Unit roundoff u (round to nearest) of f32, bf16 and f64: half the gap between 1 and the next number.
constexpr double u_f32 = 0x1p-24;
constexpr double u_bf16 = 0x1p-8;
constexpr double u_f64 = 0x1p-53;

/// γ_n = n·u / (1 − n·u), dimensionless: the relative error bound of n accumulated roundings (Higham Lemma 3.1).
inline double gamma_n(int64_t n, double u = u_f32) {
    const double nu = static_cast<double>(n) * u;
    return nu / (1.0 - nu);
}

/// γ_n · |A|·|B| in f64, n = A's last dimension: the elementwise bound on the rounding error of the product A·B
/// computed in precision u in any order (Higham (3.13)), in the units of A·B. A [.., n], B [n, ..], any float dtype.
inline torch::Tensor matmul_bound(const torch::Tensor & a, const torch::Tensor & b, double u = u_f32) {
    return gamma_n(a.size(-1), u) * torch::matmul(a.to(torch::kDouble).abs(), b.to(torch::kDouble).abs());
}

/// Passes when |got − want| ≤ bound everywhere (same shapes; compared in f64). The message gives the largest
/// |got − want| / bound (the violation: above 1 fails) with its element, both values and the bound there, so a
/// failure says by how much, and a passing negative check (EXPECT_FALSE) says how far outside it was.
inline testing::AssertionResult within_bound(const torch::Tensor & got, const torch::Tensor & want, const torch::Tensor & bound) {
    const torch::Tensor g = got.detach().to(torch::kDouble).cpu().reshape({-1});
    const torch::Tensor w = want.detach().to(torch::kDouble).cpu().reshape({-1});
    const torch::Tensor b = bound.detach().to(torch::kDouble).cpu().reshape({-1});
    const torch::Tensor diff = (g - w).abs();
    const torch::Tensor ratio = torch::where(diff == 0, torch::zeros_like(diff), diff / b);  // 0/0: equal
    const int64_t i = ratio.argmax().item<int64_t>();
    std::ostringstream s;
    s << "max |got − want| / bound = " << ratio[i].item<double>() << " at element " << i << ": got "
      << g[i].item<double>() << ", want " << w[i].item<double>() << ", bound " << b[i].item<double>();
    const bool ok = diff.le(b).all().item<bool>();
    return (ok ? testing::AssertionSuccess() : testing::AssertionFailure()) << s.str();
}

}  // namespace voodoo::test
