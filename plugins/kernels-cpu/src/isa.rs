//! Instruction-set detection, done once when the plugin is instantiated.
//!
//! The chosen [`Isa`] selects every kernel's function pointer up front (see
//! [`crate::matmul::select`] and [`crate::vecops::VecOps`]), so the hot path never re-checks CPU
//! features.

/// An instruction-set path the kernels can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust, no explicit SIMD.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (int8 dots through `vpmaddubsw`/`vpmaddwd`).
    Avx2,
    /// AVX2 integer kernels plus 512-bit float kernels (AVX-512 F/BW/VL, no VNNI).
    Avx512,
    /// [`Isa::Avx512`] with int8 dots through AVX-512 VNNI `vpdpbusd`.
    Avx512Vnni,
    /// AArch64 NEON (int8 dots through `smull`/`smlal` + `sadalp`).
    Neon,
    /// [`Isa::Neon`] with int8 dots through the dot-product extension's `sdot`.
    NeonDot,
}

impl Isa {
    /// Name reported in `BackendInfo::isa`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2+fma+f16c",
            Isa::Avx512 => "avx512f+bw+vl",
            Isa::Avx512Vnni => "avx512f+bw+vl+vnni",
            Isa::Neon => "neon",
            Isa::NeonDot => "neon+dotprod",
        }
    }

    /// The path for a short name — `scalar`, `avx2`, `avx512`, `vnni`, `neon`, `neondot` — as
    /// the deployment's `isa` setting and the benchmarks' `U_ISA` spell it.
    pub fn from_short(name: &str) -> Option<Isa> {
        Some(match name {
            "scalar" => Isa::Scalar,
            "avx2" => Isa::Avx2,
            "avx512" => Isa::Avx512,
            "vnni" => Isa::Avx512Vnni,
            "neon" => Isa::Neon,
            "neondot" => Isa::NeonDot,
            _ => return None,
        })
    }

    /// The best path this CPU supports.
    pub fn detect() -> Isa {
        *Isa::available().last().unwrap_or(&Isa::Scalar)
    }

    /// Every path this CPU can run, worst first (always starts with [`Isa::Scalar`]).
    pub fn available() -> Vec<Isa> {
        let mut out = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c");
            let avx512 = avx2
                && std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl");
            let vnni = avx512 && std::arch::is_x86_feature_detected!("avx512vnni");
            if avx2 {
                out.push(Isa::Avx2);
            }
            if avx512 {
                out.push(Isa::Avx512);
            }
            if vnni {
                out.push(Isa::Avx512Vnni);
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            let neon = std::arch::is_aarch64_feature_detected!("neon");
            if neon {
                out.push(Isa::Neon);
            }
            if neon && std::arch::is_aarch64_feature_detected!("dotprod") {
                out.push(Isa::NeonDot);
            }
        }
        out
    }

    /// Whether this CPU can run `self`.
    pub fn is_available(self) -> bool {
        Isa::available().contains(&self)
    }
}

/// CPU features relevant to the kernels that this machine has, e.g. `["avx2", "fma", "f16c"]`.
pub fn features() -> Vec<String> {
    #[allow(unused_mut)]
    let mut out: Vec<&str> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! probe {
            ($($f:tt),*) => {$(
                if std::arch::is_x86_feature_detected!($f) {
                    out.push($f);
                }
            )*};
        }
        probe!(
            "sse4.2",
            "avx",
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512vnni",
            "avx512bf16",
            "avx512fp16",
            "avxvnni"
        );
    }
    #[cfg(target_arch = "aarch64")]
    {
        macro_rules! probe {
            ($($f:tt),*) => {$(
                if std::arch::is_aarch64_feature_detected!($f) {
                    out.push($f);
                }
            )*};
        }
        probe!("neon", "dotprod", "fp16", "i8mm", "sve");
    }
    out.into_iter().map(String::from).collect()
}
