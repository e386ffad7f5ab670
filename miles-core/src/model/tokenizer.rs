//! The byte-level tokenizer: ids 0..=255 are bytes, then BOS, EOS and pad.

use super::{LlamaConfig, ModelError};

/// Encodes text as its UTF-8 bytes, with the config's special ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteTokenizer {
    /// Begin-of-sequence id.
    pub bos: u32,
    /// End-of-sequence id.
    pub eos: u32,
    /// Padding id.
    pub pad: u32,
}

impl ByteTokenizer {
    /// The tokenizer of `config`: its `bos_token_id`, `eos_token_id`, `pad_token_id`, each above
    /// the byte range and inside the vocabulary.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming the missing or clashing id.
    pub fn from_config(config: &LlamaConfig) -> Result<Self, ModelError> {
        let id = |key: &str| {
            let v = config.token_id(key).ok_or_else(|| {
                ModelError::Config(format!("{key} is missing; the byte tokenizer needs it"))
            })?;
            if v < 256 || v as usize >= config.vocab_size {
                return Err(ModelError::Config(format!(
                    "{key} = {v} must lie in 256..{} (ids below 256 are bytes)",
                    config.vocab_size
                )));
            }
            Ok(v)
        };
        Ok(Self {
            bos: id("bos_token_id")?,
            eos: id("eos_token_id")?,
            pad: id("pad_token_id")?,
        })
    }

    /// The ids of `text`, BOS first when `add_bos`.
    pub fn encode(&self, text: &str, add_bos: bool) -> Vec<u32> {
        let mut ids = Vec::with_capacity(text.len() + 1);
        if add_bos {
            ids.push(self.bos);
        }
        ids.extend(text.bytes().map(u32::from));
        ids
    }

    /// The text of `ids`, skipping special ids; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().filter_map(|&id| u8::try_from(id).ok()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_then_decode_round_trips_utf8_with_bos_first() {
        let t = ByteTokenizer::from_config(&LlamaConfig::preset("tiny").unwrap()).unwrap();
        let text = "héllo, wörld";
        let ids = t.encode(text, true);
        assert_eq!(ids[0], t.bos);
        assert_eq!(ids.len(), text.len() + 1);
        assert_eq!(t.decode(&ids), text);
    }
}
