// The rounding bound of a gate gradient ∂L/∂g of the mixture W = Σ_k softmax(g)_k·D_k (train/gated.h), for
// the tests of every mixture path (tests/test_gated.cpp on the CPU, tests/test_cuda.cpp on the GPU): the exact
// value in f64 from a path's own f32 inputs, and how far a path computing it in f32, in any summation order,
// may be from it. First order in u; each step by the rules of tolerance.h.
#pragma once

#include "tolerance.h"

#include <torch/torch.h>

#include <cstdint>

namespace voodoo::test {

/// A gate gradient from a path's own f32 inputs (p̂ = its f32 softmax, the candidates D [K, N] as f64, the
/// loss's inputs), with the bounds on how far a path computing it in f32 may be from it.
struct gate_grad_check {
    torch::Tensor g;                     // [N] ∂L/∂W
    torch::Tensor grad_p, grad_p_bound;  // [K] ∂L/∂p_k = ⟨G, D_k⟩, and the bound on a path's f32 value of it
    torch::Tensor grad, grad_bound;      // [K] ∂L/∂g, and the bound on a path's f32 gate gradient
};

/// The last two steps of every path, given G = ∂L/∂W (exact, f64 [N]) and a bound bg on the error of the G a path
/// computes: ∂L/∂p_k = ⟨G, D_k⟩ in f32 (γ_N·Σ|G||D_k| + Σ bg·|D_k|, one more rounding where f64 turns f32), then
/// softmax backward p ⊙ (∂L/∂p − pᵀ∂L/∂p) in f32 (an error e of ∂L/∂p gives p ⊙ (e + pᵀe); K + 2 roundings).
inline gate_grad_check gate_grad_from(const torch::Tensor & p, const torch::Tensor & d, const torch::Tensor & g,
                                      const torch::Tensor & bg) {
    const torch::Tensor pd = p.detach().to(torch::kDouble);
    const torch::Tensor gp = d.matmul(g);
    const torch::Tensor bgp = d.abs().matmul(bg) + matmul_bound(d, g.abs() + bg) + u_f32 * gp.abs();
    const int64_t K = d.size(0);
    const torch::Tensor gpa = gp.abs() + bgp;
    return {g, gp, bgp, pd * (gp - (pd * gp).sum()),
            pd * (bgp + (pd * bgp).sum()) + gamma_n(K + 2) * pd * (gpa + (pd * gpa).sum())};
}

/// L = ||X·Wᵀ||² (X [B, ne0]) with W = Σ_k p_k D_k [rows, ne0] formed in f32 (K terms: γ_K·|p|ᵀ|D|), Y = X·Wᵀ (ne0 terms) and
/// G = 2·Yᵀ·X (B terms) in X's precision, each γ_n·|·|·|·| plus the error of its inputs carried through |·|;
/// an f64 G is rounded once to f32 where the mixture's backward takes it.
inline gate_grad_check quadratic_loss_gate_grad(const torch::Tensor & p, const torch::Tensor & d, int64_t rows,
                                                const torch::Tensor & x) {
    const bool x64 = x.scalar_type() == torch::kDouble;
    const double ux = x64 ? u_f64 : u_f32;
    const torch::Tensor pd = p.detach().to(torch::kDouble), xd = x.to(torch::kDouble), xa = xd.abs();
    const int64_t ne0 = x.size(1);
    const torch::Tensor w = pd.matmul(d).view({rows, ne0});
    const torch::Tensor wa = pd.abs().matmul(d.abs()).view({rows, ne0});  // ≥ |W|
    const torch::Tensor bw = matmul_bound(pd, d).view({rows, ne0});
    const torch::Tensor y = xd.matmul(w.t());
    const torch::Tensor by = xa.matmul(bw.t()) + matmul_bound(xd, wa.t(), ux);
    const torch::Tensor g = 2 * y.t().matmul(xd);
    torch::Tensor bg = 2 * (by.t().matmul(xa) + matmul_bound((y.abs() + by).t(), xd, ux));
    if (x64) {
        bg = bg + u_f32 * (g.abs() + bg);
    }
    return gate_grad_from(p, d, g.view(-1), bg.view(-1));
}

}  // namespace voodoo::test
