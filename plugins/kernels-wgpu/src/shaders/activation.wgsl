// The activation functions, as the CPU kernels define them (GELU-tanh as x · sigmoid(2u);
// GELU-erf with the Numerical Recipes erfc, |error| < 1.2e-7).

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

fn erf_approx(x: f32) -> f32 {
    let z = abs(x);
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418
        + t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587
        + t * (-0.82215223 + t * 0.17087277))))))));
    let erfc = t * exp(poly);
    return select(erfc - 1.0, 1.0 - erfc, x >= 0.0);
}

// Codes: 0 SiLU, 1 GELU-tanh, 2 GELU-erf, 3 sigmoid, 4 ReLU, 5 tanh, 6 step.
fn activate(code: u32, v: f32) -> f32 {
    switch code {
        case 0u: { return v * sigmoid(v); }
        case 1u: { return v * sigmoid(2.0 * 0.7978846 * (v + 0.044715 * v * v * v)); }
        case 2u: { return 0.5 * v * (1.0 + erf_approx(v * 0.70710678)); }
        case 3u: { return sigmoid(v); }
        case 4u: { return max(v, 0.0); }
        case 5u: { return tanh(v); }
        default: { return select(0.0, 1.0, v > 0.0); }
    }
}
