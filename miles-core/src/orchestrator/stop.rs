//! Stop strings (`--rollout-stop`): the engine stops on tokens only, so the loop cuts each
//! completion after generation, before rewards, log-probs and training see it.

use crate::backend::Sample;

/// Cuts `sample` after its first token whose decoded prefix `decode(&tokens[..=i])` contains
/// one of `stops` (empty strings are ignored): the later tokens and their log-probs are
/// dropped and the sample counts as stopped. Returns the response text, which ends before the
/// earliest stop string in it, when it cut; `None` leaves the sample as it was.
///
/// The prefix is found by bisection over its length, a handful of decodes per sample: a stop
/// string that the text of a prefix holds, the text of every longer prefix holds too.
pub(super) fn cut_at_stop_strings(
    sample: &mut Sample,
    stops: &[String],
    decode: &dyn Fn(&[u32]) -> String,
) -> Option<String> {
    let stops: Vec<&str> = stops
        .iter()
        .map(String::as_str)
        .filter(|s| !s.is_empty())
        .collect();
    let first_stop = |text: &str| stops.iter().filter_map(|s| text.find(s)).min();
    first_stop(&decode(&sample.tokens))?;
    // The shortest prefix holding a stop string lies in lo..=hi; the whole one holds one.
    let (mut lo, mut hi) = (1, sample.tokens.len());
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if first_stop(&decode(&sample.tokens[..mid])).is_some() {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    sample.tokens.truncate(hi);
    sample.logprobs.truncate(hi);
    sample.stopped = true;
    let mut text = decode(&sample.tokens);
    text.truncate(first_stop(&text)?);
    Some(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ByteTokenizer;

    fn sample(text: &str, stopped: bool) -> Sample {
        let tokens: Vec<u32> = text.bytes().map(u32::from).collect();
        let logprobs = (0..tokens.len()).map(|i| -0.1 * (i + 1) as f32).collect();
        Sample {
            tokens,
            logprobs,
            stopped,
        }
    }

    fn stops(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_completion_is_cut_after_the_token_completing_the_first_stop_string() {
        let tokenizer = ByteTokenizer {
            bos: 256,
            eos: 257,
            pad: 258,
        };
        let decode = |ids: &[u32]| tokenizer.decode(ids);
        // The byte tokenizer: one token a byte. "</a>" is complete at token 8 ('>').
        let mut s = sample("x = 42</a> and more\n\n", false);
        let text = cut_at_stop_strings(&mut s, &stops(&["\n\n", "</a>"]), &decode);
        assert_eq!(text.as_deref(), Some("x = 42"));
        assert_eq!(tokenizer.decode(&s.tokens), "x = 42</a>");
        assert_eq!(s.logprobs.len(), s.tokens.len());
        assert_eq!(s.logprobs[9], -1.0, "the kept tokens keep their log-probs");
        assert!(
            s.stopped,
            "a cut sample ended by a stop, it was not truncated"
        );
    }

    #[test]
    fn a_completion_without_a_stop_string_is_left_as_it_was() {
        let tokenizer = ByteTokenizer {
            bos: 256,
            eos: 257,
            pad: 258,
        };
        let decode = |ids: &[u32]| tokenizer.decode(ids);
        let mut s = sample("no stop here", false);
        let before = s.clone();
        assert_eq!(
            cut_at_stop_strings(&mut s, &stops(&["\n\n", ""]), &decode),
            None
        );
        assert_eq!(s, before, "an empty stop string matches nothing");
        assert_eq!(cut_at_stop_strings(&mut s, &[], &decode), None);
    }

    #[test]
    fn a_stop_string_split_over_tokens_cuts_at_the_token_that_completes_it() {
        // Two-byte tokens: "ab|c\n|\nd|ef"; "\n\n" is complete in the third token.
        let pairs = ["ab", "c\n", "\nd", "ef"];
        let decode = |ids: &[u32]| -> String { ids.iter().map(|&i| pairs[i as usize]).collect() };
        let mut s = Sample {
            tokens: vec![0, 1, 2, 3],
            logprobs: vec![-0.5, -0.6, -0.7, -0.8],
            stopped: false,
        };
        let text = cut_at_stop_strings(&mut s, &stops(&["\n\n"]), &decode);
        assert_eq!(text.as_deref(), Some("abc"));
        assert_eq!(
            (s.tokens, s.logprobs),
            (vec![0, 1, 2], vec![-0.5, -0.6, -0.7])
        );
    }
}
