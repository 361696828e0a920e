// The sum of `v` over the workgroup's 64 invocations (every invocation gets it); call from
// uniform control flow.

var<workgroup> sums: array<f32, 64>;

fn workgroup_sum(t: u32, v: f32) -> f32 {
    sums[t] = v;
    workgroupBarrier();
    for (var half = 32u; half > 0u; half >>= 1u) {
        if (t < half) {
            sums[t] += sums[t + half];
        }
        workgroupBarrier();
    }
    let total = sums[0];
    workgroupBarrier();
    return total;
}
