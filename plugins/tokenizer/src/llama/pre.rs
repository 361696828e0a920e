//! The pre-tokenizers of llama.cpp's byte-pair vocabularies, by `tokenizer.ggml.pre` name.
//!
//! A name selects a [`Group`] (the pattern list the words are split with, and whether words are
//! GPT-2 byte-encoded) and a few flags of its own. The pattern texts are llama.cpp 0.3.36's,
//! so that [`super::split`] picks the same hand-written splitters by exact text.

/// A pre-tokenizer's pattern list (named after the first llama.cpp type that uses it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Group {
    /// llama.cpp's LLAMA3.
    Llama3,
    /// llama.cpp's JAIS2.
    Jais2,
    /// llama.cpp's DBRX, SMAUG.
    Dbrx,
    /// llama.cpp's DEEPSEEK_LLM.
    DeepseekLlm,
    /// llama.cpp's DEEPSEEK3_LLM, HUNYUAN_DENSE, JOYAI_LLM, HY_V4.
    Deepseek3Llm,
    /// llama.cpp's SPARK2_5.
    Spark25,
    /// llama.cpp's YOUTU.
    Youtu,
    /// llama.cpp's DEEPSEEK_CODER.
    DeepseekCoder,
    /// llama.cpp's FALCON.
    Falcon,
    /// llama.cpp's STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA, MELLUM2.
    Starcoder,
    /// llama.cpp's GPT2, MPT, OLMO, JAIS, TRILLION, GRANITE_DOCLING.
    Gpt2,
    /// llama.cpp's STABLELM2, QWEN2, HUNYUAN, SOLAR_OPEN.
    Stablelm2,
    /// llama.cpp's QWEN35.
    Qwen35,
    /// llama.cpp's PORO, BLOOM, GPT3_FINNISH.
    Poro,
    /// llama.cpp's CHATGLM4.
    Chatglm4,
    /// llama.cpp's VIKING.
    Viking,
    /// llama.cpp's TEKKEN.
    Tekken,
    /// llama.cpp's CHAMELEON.
    Chameleon,
    /// llama.cpp's GPT4O, MINIMAX_M2.
    Gpt4o,
    /// llama.cpp's GRANITE_EMB_MULTI.
    GraniteEmbMulti,
    /// llama.cpp's TINY_AYA.
    TinyAya,
    /// llama.cpp's KIMI_K2.
    KimiK2,
    /// llama.cpp's SUPERBPE.
    Superbpe,
    /// llama.cpp's BAILINGMOE.
    Bailingmoe,
    /// llama.cpp's SEED_CODER.
    SeedCoder,
    /// llama.cpp's UFAKZEKA.
    Ufakzeka,
    /// llama.cpp's GROK_2.
    Grok2,
    /// llama.cpp's AFMOE.
    Afmoe,
    /// llama.cpp's LAGUNA.
    Laguna,
    /// llama.cpp's EXAONE_MOE.
    ExaoneMoe,
    /// llama.cpp's GEMMA4.
    Gemma4,
    /// llama.cpp's SARVAM_MOE.
    SarvamMoe,
    /// llama.cpp's MINICPM5.
    Minicpm5,
    /// llama.cpp's WHITESPACE.
    Whitespace,
    /// llama.cpp's default.
    Default,
}

impl Group {
    /// The patterns, applied in order, and whether words are byte-encoded (GPT-2's alphabet)
    /// rather than kept as UTF-8.
    pub fn patterns(self) -> (&'static [&'static str], bool) {
        match self {
            Group::Llama3 => (
                &[
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::Jais2 => (
                &[
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}(?!\\S)|\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}",
                ],
                true,
            ),
            Group::Dbrx => (
                &[
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::DeepseekLlm => (
                &[
                    "[\r\n]",
                    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
                    "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
                    "\\s+$",
                    "[一-龥ࠀ-一가-퟿]+",
                    "\\p{N}+",
                ],
                true,
            ),
            Group::Deepseek3Llm => (
                &[
                    "\\p{N}{1,3}",
                    "[一-龥぀-ゟ゠-ヿ]+",
                    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::Spark25 => (
                &[
                    "\\p{N}{1,3}",
                    "[一-龥぀-ゟ゠-ヿ]+",
                    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+",
                    "\\p{N}",
                ],
                true,
            ),
            Group::Youtu => (
                &[
                    "[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
                    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::DeepseekCoder => (
                &[
                    "[\r\n]",
                    "\\s?\\p{L}+",
                    "\\s?\\p{P}+",
                    "[一-龥ࠀ-一가-퟿]+",
                    "\\p{N}",
                ],
                true,
            ),
            Group::Falcon => (
                &[
                    "[\\p{P}\\$\\+<=>\\^~\\|`]+",
                    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
                    "[0-9][0-9][0-9]",
                ],
                true,
            ),
            Group::Starcoder => (
                &[
                    "\\p{N}",
                    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
                ],
                true,
            ),
            Group::Gpt2 => (
                &["'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"],
                true,
            ),
            Group::Stablelm2 => (
                &[
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::Qwen35 => (
                &[
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::Poro => (&[" ?[^(\\s|.,!?…。，、।۔،)]+"], true),
            Group::Chatglm4 => (
                &[
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::Viking => (&[" ?[^(\\s|.,!?…。，、।۔،)]+", "\\p{N}"], true),
            Group::Tekken => (
                &[
                    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::Chameleon => (
                &[
                    "<sentinel:[0-9]+>",
                    "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                    "([\\t\\n]|    |  )",
                    "\\p{N}",
                    "[\\p{P}!-/:-@\\[-`{-~]",
                    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
                ],
                true,
            ),
            Group::Gpt4o => (
                &[
                    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::GraniteEmbMulti => (
                &[
                    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))*((?=[\\p{L}\\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))+((?=[\\p{L}\\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::TinyAya => (
                &[
                    "\\d{1,3}(?=(?:\\d{3})*\\b)",
                    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::KimiK2 => (&["\\p{Han}+"], true),
            Group::Superbpe => (&["\\p{N}+", "(?=(\\d{3})+(?!\\d))"], true),
            Group::Bailingmoe => (
                &[
                    "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::SeedCoder => (
                &[
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::Ufakzeka => (
                &[
                    "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::Grok2 => (
                &[
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::Afmoe => (
                &[
                    "\\p{AFMoE_digits}",
                    "[一-鿿㐀-䶿豈-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+",
                    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::Laguna => (
                &[
                    "[^\\n]+|[\\n]+",
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::ExaoneMoe => (
                &[
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::Gemma4 => (&["[^\\n]+|[\\n]+"], false),
            Group::SarvamMoe => (&["[^\\n]+|[\\n]+"], false),
            Group::Minicpm5 => (
                &[
                    "\\p{N}{1,3}",
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            Group::Whitespace => (&["\\S+"], false),
            Group::Default => (
                &[
                    "[\\p{P}\\$\\+<=>\\^~\\|]+",
                    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
                    "\\p{N}+",
                    "[0-9][0-9][0-9]",
                ],
                true,
            ),
        }
    }
}

/// What a `tokenizer.ggml.pre` name selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pre {
    /// The pattern list.
    pub group: Group,
    /// A whole word that is a token is that token, without merging.
    pub ignore_merges: bool,
    /// Adds BOS by default (the GGUF's `add_bos_token` still decides).
    pub add_bos: bool,
    /// Adds SEP by default (embedding models; tokenization never appends it).
    pub add_sep: bool,
    /// Spaces become `▁` before splitting (SentencePiece-style BPE).
    pub escape_whitespaces: bool,
    /// The vocabulary has no BOS token, whatever the GGUF says.
    pub no_bos: bool,
    /// Decoding removes the spaces English punctuation and contractions do not take.
    pub clean_spaces: bool,
}

impl Pre {
    const fn of(group: Group) -> Pre {
        Pre {
            group,
            ignore_merges: false,
            add_bos: false,
            add_sep: false,
            escape_whitespaces: false,
            no_bos: false,
            clean_spaces: true,
        }
    }
    const fn ignore_merges(mut self) -> Pre {
        self.ignore_merges = true;
        self
    }
    const fn bos(mut self) -> Pre {
        self.add_bos = true;
        self
    }
    const fn sep(mut self) -> Pre {
        self.add_sep = true;
        self
    }
    const fn escaped(mut self) -> Pre {
        self.escape_whitespaces = true;
        self
    }
    const fn no_bos(mut self) -> Pre {
        self.no_bos = true;
        self
    }
    const fn raw_spaces(mut self) -> Pre {
        self.clean_spaces = false;
        self
    }

    /// Every name llama.cpp 0.3.36 knows, in the order its vocabulary loader tests them.
    pub const NAMES: [&str; 91] = [
        "default",
        "minicpm5",
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
        "jina-v5-nano",
        "deepseek-llm",
        "deepseek-coder",
        "deepseek-v3",
        "spark2_5",
        "youtu",
        "falcon",
        "mpt",
        "starcoder",
        "gpt-2",
        "phi-2",
        "jina-es",
        "jina-de",
        "gigachat",
        "jina-v2-es",
        "jina-v2-de",
        "a.x-4.0",
        "mellum",
        "modern-bert",
        "jais-2",
        "gemma4",
        "granite-embed-multi-311m",
        "sarvam-moe",
        "jina-v1-en",
        "jina-v2-code",
        "roberta-bpe",
        "whitespace",
        "refact",
        "command-r",
        "qwen2",
        "deepseek-r1-qwen",
        "kormo",
        "f2llmv2",
        "qwen35",
        "stablelm2",
        "olmo",
        "dbrx",
        "smaug-bpe",
        "poro-chat",
        "chatglm-bpe",
        "glm4",
        "glm5",
        "viking",
        "jais",
        "tekken",
        "smollm",
        "codeshell",
        "bloom",
        "gpt3-finnish",
        "exaone",
        "exaone4",
        "exaone-moe",
        "chameleon",
        "minerva-7b",
        "megrez",
        "gpt-4o",
        "llama4",
        "kanana2",
        "talkie",
        "granite-embed-multi-97m",
        "tiny_aya",
        "cohere2moe",
        "superbpe",
        "trillion",
        "granite-docling",
        "bailingmoe",
        "bailingmoe2",
        "llada-moe",
        "seed-coder",
        "hunyuan",
        "hunyuan-dense",
        "hy_v4",
        "joyai-llm",
        "kimi-k2",
        "ufakzeka",
        "grok-2",
        "afmoe",
        "laguna",
        "minimax-m2",
        "solar-open",
        "mellum2",
    ];

    /// The pre-tokenizer of `name`; `None` for a name llama.cpp does not know. An empty name
    /// is llama.cpp's default (which it warns degrades quality).
    pub fn by_name(name: &str) -> Option<Pre> {
        use Group as G;
        let p = Pre::of;
        Some(match name {
            "" | "default" => p(G::Default),
            "minicpm5" => p(G::Minicpm5).ignore_merges(),
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral"
            | "midm-2.0" | "lfm2" | "jina-v5-nano" => p(G::Llama3).ignore_merges().bos(),
            "deepseek-llm" => p(G::DeepseekLlm).raw_spaces(),
            "deepseek-coder" => p(G::DeepseekCoder).raw_spaces(),
            "deepseek-v3" => p(G::Deepseek3Llm).raw_spaces(),
            "spark2_5" => p(G::Spark25).raw_spaces(),
            "youtu" => p(G::Youtu).raw_spaces().ignore_merges(),
            "falcon" => p(G::Falcon),
            "mpt" | "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es"
            | "jina-v2-de" | "a.x-4.0" | "mellum" | "modern-bert" | "olmo" | "jais" | "exaone4" => {
                p(G::Gpt2)
            }
            "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
                p(G::Starcoder)
            }
            "command-r" | "smollm" => p(G::Starcoder).raw_spaces(),
            "jais-2" => p(G::Jais2),
            "gemma4" | "granite-embed-multi-311m" => p(G::Gemma4).escaped(),
            "sarvam-moe" => p(G::SarvamMoe).escaped().raw_spaces(),
            "jina-v1-en" | "jina-v2-code" | "roberta-bpe" => p(G::Gpt2).sep(),
            "whitespace" => p(G::Whitespace),
            "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" => p(G::Stablelm2).raw_spaces(),
            "megrez" | "stablelm2" => p(G::Stablelm2),
            "qwen35" => p(G::Qwen35).raw_spaces(),
            "dbrx" | "smaug-bpe" => p(G::Dbrx),
            "poro-chat" => p(G::Poro).raw_spaces(),
            "bloom" | "gpt3-finnish" => p(G::Poro),
            "chatglm-bpe" => p(G::Chatglm4).no_bos(),
            "glm4" | "glm5" => p(G::Chatglm4).no_bos().ignore_merges(),
            "viking" => p(G::Viking).raw_spaces(),
            "tekken" => p(G::Tekken).raw_spaces().ignore_merges().bos(),
            "exaone-moe" => p(G::ExaoneMoe),
            "chameleon" => p(G::Chameleon).bos().raw_spaces(),
            "gpt-4o" | "llama4" | "kanana2" | "talkie" => p(G::Gpt4o).raw_spaces(),
            "minimax-m2" => p(G::Gpt4o).raw_spaces(),
            "granite-embed-multi-97m" => p(G::GraniteEmbMulti).raw_spaces().ignore_merges(),
            "tiny_aya" | "cohere2moe" => p(G::TinyAya).raw_spaces(),
            "superbpe" => p(G::Superbpe).raw_spaces(),
            "trillion" | "granite-docling" => p(G::Gpt2).raw_spaces(),
            "bailingmoe" | "bailingmoe2" | "llada-moe" => p(G::Bailingmoe).raw_spaces(),
            "seed-coder" => p(G::SeedCoder).raw_spaces(),
            "hunyuan" | "solar-open" => p(G::Stablelm2).raw_spaces(),
            "hunyuan-dense" | "hy_v4" | "joyai-llm" => p(G::Deepseek3Llm).raw_spaces(),
            "kimi-k2" => p(G::KimiK2).raw_spaces(),
            "ufakzeka" => p(G::Ufakzeka).raw_spaces(),
            "grok-2" => p(G::Grok2).raw_spaces(),
            "afmoe" => p(G::Afmoe).raw_spaces(),
            "laguna" => p(G::Laguna).raw_spaces(),
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_is_known_and_its_patterns_compile() {
        for name in Pre::NAMES {
            let pre = Pre::by_name(name).unwrap_or_else(|| panic!("{name} unknown"));
            let (patterns, _) = pre.group.patterns();
            super::super::split::Splitter::new(patterns).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        assert!(Pre::by_name("no-such-pre").is_none());
    }
}
