//! The tokenizer a model is run with: the byte tokenizer of the presets, or a Hugging Face
//! directory's `tokenizer.json` (through Hugging Face's own `tokenizers` crate) with its special
//! tokens and chat template.
//!
//! Special ids are gathered as transformers gathers them: `bos`/`eos`/`pad` tokens from
//! `tokenizer_config.json`, `eos_token_id` (one id or a list: several stop tokens) from
//! `generation_config.json` and `config.json`. Text is encoded with the tokenizer's own
//! post-processor (so BOS goes where Hugging Face puts it, and nowhere for Qwen), and chat
//! prompts are rendered from the Jinja `chat_template` with minijinja.

use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use super::config::read_small_file;
use super::{ByteTokenizer, LlamaConfig, ModelError};

/// The tokenizer file of a Hugging Face directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// A model's tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    kind: Kind,
    bos: Option<u32>,
    stop: Vec<u32>,
    pad: u32,
    chat_template: Option<String>,
    bos_text: String,
    eos_text: String,
}

#[derive(Clone)]
enum Kind {
    Byte(ByteTokenizer),
    Hf(Arc<tokenizers::Tokenizer>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field(
                "kind",
                &match self.kind {
                    Kind::Byte(_) => "byte",
                    Kind::Hf(_) => "tokenizer.json",
                },
            )
            .field("bos", &self.bos)
            .field("stop", &self.stop)
            .field("pad", &self.pad)
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

impl From<ByteTokenizer> for Tokenizer {
    fn from(t: ByteTokenizer) -> Self {
        Self {
            kind: Kind::Byte(t),
            bos: Some(t.bos),
            stop: vec![t.eos],
            pad: t.pad,
            chat_template: None,
            bos_text: String::new(),
            eos_text: String::new(),
        }
    }
}

/// A special token of tokenizer_config.json: a string or an `AddedToken` object.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// The ids of an `eos_token_id`-style value: one id or a list.
fn ids_of(v: Option<&Value>) -> Vec<u32> {
    let id = |v: &Value| v.as_u64().and_then(|x| u32::try_from(x).ok());
    match v {
        Some(Value::Array(a)) => a.iter().filter_map(id).collect(),
        Some(v) => id(v).into_iter().collect(),
        None => Vec::new(),
    }
}

fn read_json(path: &Path) -> Result<Option<Value>, ModelError> {
    if !path.exists() {
        return Ok(None);
    }
    let text = read_small_file(path, 64 << 20)?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })
}

impl Tokenizer {
    /// The tokenizer of the Hugging Face directory `dir` of the model `config`: its
    /// `tokenizer.json` when it has one, else the byte tokenizer of `config`'s special ids.
    ///
    /// # Errors
    /// [`ModelError::Io`] or [`ModelError::Json`] for unreadable files;
    /// [`ModelError::Tokenizer`] for a `tokenizer.json` the `tokenizers` crate refuses, a
    /// special token it does not know, a vocabulary larger than the model's, or no end token.
    pub fn from_dir(dir: &Path, config: &LlamaConfig) -> Result<Self, ModelError> {
        let file = dir.join(TOKENIZER_FILE);
        if !file.exists() {
            return Ok(ByteTokenizer::from_config(config)?.into());
        }
        let bad = |reason: String| ModelError::Tokenizer {
            path: file.clone(),
            reason,
        };
        let text = read_small_file(&file, 256 << 20)?;
        let tk =
            tokenizers::Tokenizer::from_bytes(text.as_bytes()).map_err(|e| bad(e.to_string()))?;
        let vocab = tk.get_vocab_size(true);
        if vocab > config.vocab_size {
            return Err(bad(format!(
                "it has {vocab} tokens, more than the model's vocab_size {}",
                config.vocab_size
            )));
        }
        let tc = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
        let gen_config = read_json(&dir.join("generation_config.json"))?.unwrap_or(Value::Null);
        let id_of = |key: &str| -> Result<Option<(u32, String)>, ModelError> {
            let Some(text) = token_text(tc.get(key)) else {
                return Ok(None);
            };
            match tk.token_to_id(&text) {
                Some(id) => Ok(Some((id, text))),
                None => Err(bad(format!(
                    "tokenizer_config.json's {key} \"{text}\" is not a token of tokenizer.json"
                ))),
            }
        };
        let bos = id_of("bos_token")?;
        let eos = id_of("eos_token")?;
        let pad = id_of("pad_token")?;
        let mut stop: Vec<u32> = Vec::new();
        let mut add = |ids: Vec<u32>| {
            for id in ids {
                if !stop.contains(&id) {
                    stop.push(id);
                }
            }
        };
        add(ids_of(gen_config.get("eos_token_id")));
        add(config.eos_token_ids());
        add(eos.iter().map(|(id, _)| *id).collect());
        let Some(&first_stop) = stop.first() else {
            return Err(bad(
                "no end-of-sequence token: set eos_token in tokenizer_config.json or eos_token_id in config.json".into(),
            ));
        };
        let pad = pad
            .map(|(id, _)| id)
            .or_else(|| config.token_id("pad_token_id"))
            .or_else(|| ids_of(gen_config.get("pad_token_id")).first().copied())
            .unwrap_or(first_stop);
        let bos_id = bos
            .as_ref()
            .map(|(id, _)| *id)
            .or_else(|| config.token_id("bos_token_id"));
        let chat_template = match tc.get("chat_template") {
            Some(Value::String(t)) => Some(t.clone()),
            _ => {
                let jinja = dir.join("chat_template.jinja");
                if jinja.exists() {
                    Some(read_small_file(&jinja, 16 << 20)?)
                } else {
                    None
                }
            }
        };
        Ok(Self {
            kind: Kind::Hf(Arc::new(tk)),
            bos: bos_id,
            stop,
            pad,
            chat_template,
            bos_text: bos.map(|(_, t)| t).unwrap_or_default(),
            eos_text: eos.map(|(_, t)| t).unwrap_or_default(),
        })
    }

    /// The ids of `text`; with `special`, the special tokens the tokenizer adds (BOS for
    /// Llama, none for Qwen; always BOS for the byte tokenizer).
    ///
    /// # Errors
    /// [`ModelError::Tokenizer`] when the `tokenizers` crate fails.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, ModelError> {
        match &self.kind {
            Kind::Byte(t) => Ok(t.encode(text, special)),
            Kind::Hf(t) => t
                .encode(text, special)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| ModelError::Tokenizer {
                    path: TOKENIZER_FILE.into(),
                    reason: format!("cannot encode text: {e}"),
                }),
        }
    }

    /// The text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        match &self.kind {
            Kind::Byte(t) => t.decode(ids),
            Kind::Hf(t) => t.decode(ids, true).unwrap_or_default(),
        }
    }

    /// The begin-of-sequence id, if the model has one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The first end-of-sequence id.
    pub fn eos(&self) -> u32 {
        self.stop.first().copied().unwrap_or(self.pad)
    }

    /// Every id that ends a generation.
    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop
    }

    /// The padding id.
    pub fn pad(&self) -> u32 {
        self.pad
    }

    /// Whether the tokenizer carries a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// `prompt` as one user message rendered by the chat template, with the generation prompt
    /// added, then encoded without adding special tokens (as transformers'
    /// `apply_chat_template(..., add_generation_prompt=True)` does).
    ///
    /// # Errors
    /// [`ModelError::Tokenizer`] when there is no template or it fails to render.
    pub fn apply_chat_template(&self, prompt: &str) -> Result<Vec<u32>, ModelError> {
        let text = self.render_chat(prompt)?;
        self.encode(&text, false)
    }

    /// The text of `prompt` rendered by the chat template (see
    /// [`apply_chat_template`](Self::apply_chat_template)).
    ///
    /// # Errors
    /// As [`apply_chat_template`](Self::apply_chat_template).
    pub fn render_chat(&self, prompt: &str) -> Result<String, ModelError> {
        let bad = |reason: String| ModelError::Tokenizer {
            path: "tokenizer_config.json".into(),
            reason,
        };
        let Some(template) = &self.chat_template else {
            return Err(bad(
                "no chat_template in tokenizer_config.json nor chat_template.jinja; leave out --apply-chat-template".into(),
            ));
        };
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", template)
            .map_err(|e| bad(format!("the chat template does not parse: {e}")))?;
        let tmpl = env
            .get_template("chat")
            .map_err(|e| bad(format!("the chat template does not load: {e}")))?;
        tmpl.render(minijinja::context! {
            messages => vec![minijinja::context! { role => "user", content => prompt }],
            add_generation_prompt => true,
            bos_token => self.bos_text.as_str(),
            eos_token => self.eos_text.as_str(),
        })
        .map_err(|e| bad(format!("the chat template fails to render: {e}")))
    }

    /// What the tokenizer is: `byte` or `tokenizer.json`.
    pub fn kind_name(&self) -> &'static str {
        match self.kind {
            Kind::Byte(_) => "byte",
            Kind::Hf(_) => "tokenizer.json",
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use tokenizers::models::TrainerWrapper;
    use tokenizers::models::bpe::{BPE, BpeTrainer};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::processors::template::TemplateProcessing;
    use tokenizers::{AddedToken, DecoderWrapper, PostProcessorWrapper, PreTokenizerWrapper};

    use super::*;

    /// Special tokens of the test tokenizers: ids 0, 1 and 2 after training.
    pub(crate) const SPECIALS: [&str; 3] = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"];

    /// A chat template in the style of Llama 3 and Qwen (`.strip()` needs Python compatibility).
    pub(crate) const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'].strip() }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";

    /// Writes `tokenizer.json` (byte-level BPE of about `vocab` tokens trained here by the
    /// `tokenizers` crate's own trainer; BOS added by its post-processor when `bos`) and a
    /// `tokenizer_config.json` with special tokens and a chat template into `dir`.
    pub(crate) fn write_tokenizer(dir: &Path, vocab: usize, bos: bool) {
        let mut tk = tokenizers::Tokenizer::new(BPE::default());
        // As GPT-2, Llama 3 and Qwen: no prefix space.
        let byte_level = ByteLevel::new(false, true, true);
        tk.with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(byte_level)));
        tk.with_decoder(Some(DecoderWrapper::ByteLevel(byte_level)));
        let mut trainer: TrainerWrapper = BpeTrainer::builder()
            .vocab_size(vocab)
            .show_progress(false)
            .special_tokens(
                SPECIALS
                    .iter()
                    .map(|s| AddedToken::from(*s, true))
                    .collect(),
            )
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build()
            .into();
        let corpus = [
            "the quick brown fox jumps over the lazy dog",
            "hello world, hello miles; tokenizers train byte-level pairs",
            "1 + 2 = 3 and 4 * 5 = 20, the answer is 42",
            "a user asks and the assistant answers in a chat",
        ];
        tk.train(&mut trainer, corpus.iter().cycle().take(64))
            .unwrap();
        if bos {
            let post = TemplateProcessing::builder()
                .try_single(format!("{} $A", SPECIALS[0]))
                .unwrap()
                .special_tokens(vec![(SPECIALS[0], 0)])
                .build()
                .unwrap();
            tk.with_post_processor(Some(PostProcessorWrapper::Template(post)));
        }
        tk.save(dir.join(TOKENIZER_FILE), false).unwrap();
        let config = serde_json::json!({
            "bos_token": if bos { Value::String(SPECIALS[0].into()) } else { Value::Null },
            "eos_token": {"content": SPECIALS[2], "special": true},
            "pad_token": SPECIALS[1],
            "chat_template": CHAT_TEMPLATE,
        });
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        std::fs::write(
            dir.join("generation_config.json"),
            serde_json::json!({"eos_token_id": [2, 1]}).to_string(),
        )
        .unwrap();
    }

    fn config(vocab: usize) -> LlamaConfig {
        let mut v: Value = serde_json::from_str(include_str!("../../presets/tiny.json")).unwrap();
        v["vocab_size"] = serde_json::json!(vocab);
        v["bos_token_id"] = serde_json::json!(0);
        v["eos_token_id"] = serde_json::json!([2, 1]);
        v["pad_token_id"] = serde_json::json!(1);
        LlamaConfig::from_json_str(&v.to_string()).unwrap()
    }

    #[test]
    fn ids_equal_the_tokenizers_crate_with_bos_placed_by_the_post_processor() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), 300, true);
        let t = Tokenizer::from_dir(dir.path(), &config(320)).unwrap();
        let reference = tokenizers::Tokenizer::from_file(dir.path().join(TOKENIZER_FILE)).unwrap();
        let text = "hello world, the answer is 42";
        let want = reference.encode(text, true).unwrap().get_ids().to_vec();
        let got = t.encode(text, true).unwrap();
        assert_eq!(got, want);
        assert_eq!(got[0], 0, "bos first");
        assert!(got.len() < text.len(), "merges were learnt: {got:?}");
        assert_eq!(t.encode(text, false).unwrap(), want[1..]);
        assert_eq!(t.decode(&got), text);
        assert_eq!((t.bos(), t.eos(), t.pad()), (Some(0), 2, 1));
        assert_eq!(t.stop_tokens(), &[2, 1]);
    }

    #[test]
    fn the_chat_template_renders_a_user_prompt_with_the_generation_prompt() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), 300, false);
        let t = Tokenizer::from_dir(dir.path(), &config(320)).unwrap();
        assert_eq!(t.bos(), Some(0), "from config.json");
        let text = t.render_chat("  what is 1 + 2? ").unwrap();
        assert_eq!(text, "<|user|>what is 1 + 2?<|eot_id|><|assistant|>");
        let ids = t.apply_chat_template("  what is 1 + 2? ").unwrap();
        assert!(ids.contains(&2), "<|eot_id|> is one special token: {ids:?}");
        assert_eq!(t.decode(&ids), "<|user|>what is 1 + 2?<|assistant|>");
    }

    #[test]
    fn a_tokenizer_larger_than_the_model_or_without_its_special_token_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), 300, true);
        let err = Tokenizer::from_dir(dir.path(), &config(100))
            .unwrap_err()
            .to_string();
        assert!(err.contains("vocab_size 100"), "{err}");
        let tc = dir.path().join("tokenizer_config.json");
        std::fs::write(&tc, r#"{"eos_token": "<none>"}"#).unwrap();
        let err = Tokenizer::from_dir(dir.path(), &config(320))
            .unwrap_err()
            .to_string();
        assert!(err.contains("eos_token \"<none>\""), "{err}");
    }
}
