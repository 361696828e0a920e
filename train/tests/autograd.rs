//! Autograd against PyTorch (`tests/fixtures/gen_autograd.py`): gradients of two MLPs (ReLU with
//! softmax cross-entropy, sigmoid with mean squared error) to 1e-5, three AdamW steps with
//! gradient clipping and three SGD-with-momentum steps to 1e-6; and the seed's XOR example
//! trains to 4/4 — every forward and backward operation on kernels-cpu.

use anyhow::Result;
use serde_json::Value;
use u_sdk::nn::Device;
use u_train::{
    Graph, Param, Var, grad_values,
    optim::{Adam, Sgd, clip_grad_norm},
};

fn device() -> Result<Device> {
    Ok(Device::new(u_kernels_cpu::CpuKernels::new(1)?.into_box())?)
}

fn fixture() -> Result<Value> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/autograd.json");
    Ok(serde_json::from_slice(&std::fs::read(path)?)?)
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Weights `[out, in]` and biases `[out]` of an MLP of layer `sizes`, from `values`.
fn mlp(values: &Value, sizes: &[u64]) -> Result<Vec<Param>> {
    let lists = values.as_array().unwrap();
    let mut params = Vec::new();
    for (l, io) in sizes.windows(2).enumerate() {
        params.push(Param::new(floats(&lists[2 * l]), &[io[1], io[0]])?);
        params.push(Param::new(floats(&lists[2 * l + 1]), &[io[1]])?);
    }
    Ok(params)
}

/// The loss of a two-layer MLP and the parameters' leaves.
enum Head<'a> {
    CrossEntropy(&'a [u32]),
    Mse(&'a [f32]),
}

fn forward(
    g: &Graph,
    params: &[Param],
    x: &[f32],
    rows: u64,
    hidden_relu: bool,
    head: &Head<'_>,
) -> Result<(Var, f32, Vec<Var>)> {
    let leaves: Vec<Var> = params
        .iter()
        .map(|p| p.leaf(g))
        .collect::<u_sdk::Result<_>>()?;
    let inputs = params[0].dims[1];
    let x = g.leaf(x, &[rows, inputs])?;
    let h = g.linear(x, leaves[0], leaves[1])?;
    let h = if hidden_relu {
        g.relu(h)?
    } else {
        g.sigmoid(h)?
    };
    let z = g.linear(h, leaves[2], leaves[3])?;
    let (loss, value) = match head {
        Head::CrossEntropy(t) => g.cross_entropy(z, t)?,
        Head::Mse(t) => {
            let y = g.sigmoid(z)?;
            g.mse(y, t)?
        }
    };
    Ok((loss, value, leaves))
}

fn gradients(
    params: &[Param],
    x: &[f32],
    rows: u64,
    relu: bool,
    head: &Head<'_>,
) -> Result<(f32, Vec<Vec<f32>>)> {
    let g = Graph::new(device()?);
    let (loss, value, leaves) = forward(&g, params, x, rows, relu, head)?;
    g.backward(loss)?;
    let grads = leaves
        .iter()
        .map(|&v| grad_values(&g, v))
        .collect::<u_sdk::Result<_>>()?;
    Ok((value, grads))
}

#[test]
fn gradients_equal_pytorch_autograd() -> Result<()> {
    let f = fixture()?;
    let ce = &f["relu_ce"];
    let targets: Vec<u32> = ce["y"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let params = mlp(&ce["params"], &[3, 5, 4])?;
    let (loss, grads) = gradients(
        &params,
        &floats(&ce["x"]),
        6,
        true,
        &Head::CrossEntropy(&targets),
    )?;
    assert!(
        (loss - ce["loss"].as_f64().unwrap() as f32).abs() < 1e-5,
        "loss {loss}"
    );
    for (got, want) in grads.iter().zip(ce["grads"].as_array().unwrap()) {
        let d = max_diff(got, &floats(want));
        assert!(d < 1e-5, "relu + cross-entropy gradient off by {d}");
    }
    let mse = &f["sigmoid_mse"];
    let params = mlp(&mse["params"], &[2, 3, 1])?;
    let t = floats(&mse["t"]);
    let (loss, grads) = gradients(&params, &floats(&mse["x"]), 4, false, &Head::Mse(&t))?;
    assert!(
        (loss - mse["loss"].as_f64().unwrap() as f32).abs() < 1e-6,
        "loss {loss}"
    );
    let mut worst = 0f32;
    for (got, want) in grads.iter().zip(mse["grads"].as_array().unwrap()) {
        worst = worst.max(max_diff(got, &floats(want)));
    }
    assert!(worst < 1e-5, "sigmoid + MSE gradient off by {worst}");
    Ok(())
}

#[test]
fn adamw_with_clipping_and_sgd_with_momentum_step_as_pytorch() -> Result<()> {
    let f = fixture()?;
    let ce = &f["relu_ce"];
    let targets: Vec<u32> = ce["y"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let x = floats(&ce["x"]);
    let mut params = mlp(&ce["params"], &[3, 5, 4])?;
    let mut opt = Adam::adamw(0.01, 0.01);
    let want_norms = floats(&f["adamw"]["norms"]);
    for want_norm in want_norms {
        let (_, mut grads) = gradients(&params, &x, 6, true, &Head::CrossEntropy(&targets))?;
        let norm = clip_grad_norm(&mut grads, 1.0);
        assert!(
            (norm - want_norm).abs() < 1e-5,
            "norm {norm} vs {want_norm}"
        );
        opt.step(&mut params, &grads)?;
    }
    for (p, want) in params.iter().zip(f["adamw"]["params"].as_array().unwrap()) {
        let d = max_diff(&p.values, &floats(want));
        assert!(d < 1e-6, "AdamW parameters off by {d}");
    }
    let mse = &f["sigmoid_mse"];
    let (x, t) = (floats(&mse["x"]), floats(&mse["t"]));
    let mut params = mlp(&mse["params"], &[2, 3, 1])?;
    let mut opt = Sgd::new(0.5, 0.9);
    for _ in 0..3 {
        let (_, grads) = gradients(&params, &x, 4, false, &Head::Mse(&t))?;
        opt.step(&mut params, &grads)?;
    }
    for (p, want) in params.iter().zip(f["sgd"]["params"].as_array().unwrap()) {
        let d = max_diff(&p.values, &floats(want));
        assert!(d < 1e-6, "SGD parameters off by {d}");
    }
    Ok(())
}

/// The seed's example: a 2-4-1 sigmoid network learns XOR (MSE, Adam).
#[test]
fn xor_trains_to_four_of_four() -> Result<()> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut uniform = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let mut params = vec![
        Param::new((0..8).map(|_| uniform()).collect(), &[4, 2])?,
        Param::new(vec![0.0; 4], &[4])?,
        Param::new((0..4).map(|_| uniform()).collect(), &[1, 4])?,
        Param::new(vec![0.0], &[1])?,
    ];
    let x = [0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0];
    let t = [0.0, 1.0, 1.0, 0.0];
    let mut opt = Adam::new(0.1);
    let mut steps = 0;
    let (outputs, loss) = loop {
        let g = Graph::new(device()?);
        let leaves: Vec<Var> = params
            .iter()
            .map(|p| p.leaf(&g))
            .collect::<u_sdk::Result<_>>()?;
        let xv = g.leaf(&x, &[4, 2])?;
        let h = g.linear(xv, leaves[0], leaves[1])?;
        let h = g.sigmoid(h)?;
        let z = g.linear(h, leaves[2], leaves[3])?;
        let y = g.sigmoid(z)?;
        let (loss, value) = g.mse(y, &t)?;
        let outputs = g.value(y).to_vec()?;
        steps += 1;
        let right = outputs
            .iter()
            .zip(&t)
            .filter(|(o, t)| (**o > 0.5) == (**t > 0.5))
            .count();
        if (right == 4 && value < 0.02) || steps == 3000 {
            break (outputs, value);
        }
        g.backward(loss)?;
        let grads: Vec<Vec<f32>> = leaves
            .iter()
            .map(|&v| grad_values(&g, v))
            .collect::<u_sdk::Result<_>>()?;
        opt.step(&mut params, &grads)?;
    };
    eprintln!("XOR after {steps} steps: {outputs:?}, loss {loss:.4}");
    let right = outputs
        .iter()
        .zip(&t)
        .filter(|(o, t)| (**o > 0.5) == (**t > 0.5))
        .count();
    assert_eq!(right, 4, "{outputs:?}");
    assert!(loss < 0.02);
    Ok(())
}
