//! A scheduler from any `scheduler_config.json` text (the first byte sets the step count, the
//! next one a dynamic-shift μ) is refused with an error or runs its whole loop on a small
//! sample without a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [steps, mu, rest @ ..] = data else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let Ok(s) = u_diffusion::from_config(text, usize::from(*steps), Some(f64::from(*mu) / 64.0))
    else {
        return;
    };
    let mut sample = vec![0.25f32; 16];
    for i in 0..s.timesteps().len() {
        let mut x = sample.clone();
        s.scale_model_input(&mut x, i).expect("a step of the schedule");
        let noise = vec![0.5f32; 16];
        let noise = s.needs_noise(i).then_some(noise.as_slice());
        sample = s.step(&x, i, &sample, noise).expect("a step of the schedule");
    }
});
