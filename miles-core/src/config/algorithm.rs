//! The rules of the data, reward and loss settings (issue 20), checked on resolved settings
//! next to the rules of DESIGN section 3.

use super::{Settings, SettingsError};

/// Every data, reward or loss setting that cannot run.
pub(crate) fn check(s: &Settings) -> Vec<SettingsError> {
    let mut errors = Vec::new();
    let mut refuse = |message: String| errors.push(SettingsError::Algorithm(message));
    if s.prompt_data.is_some() && s.sft_warmup_steps > 0 && s.label_key.is_none() {
        refuse(
            "--sft-warmup-steps with --prompt-data trains on the rows' labels; add --label-key KEY or drop --sft-warmup-steps".into(),
        );
    }
    if s.prompt_data.is_some() && s.rm_type.is_none() && s.custom_rm_command.is_none() {
        refuse(
            "--prompt-data needs a reward: add --rm-type math|exact|task or --custom-rm-command CMD".into(),
        );
    }
    if let Some(rm) = s.rm_type
        && s.prompt_data.is_some()
        && s.label_key.is_none()
        && s.custom_rm_command.is_none()
    {
        refuse(format!(
            "--rm-type {rm} compares against the rows' labels; add --label-key KEY"
        ));
    }
    if s.custom_rm_command
        .as_deref()
        .is_some_and(|c| c.trim().is_empty())
    {
        refuse("--custom-rm-command is empty; give the command line of the reward process".into());
    }
    let t = s.custom_rm_timeout;
    if !(t.is_finite() && t > 0.0) {
        refuse(format!(
            "--custom-rm-timeout must be a number of seconds above 0 (got {t})"
        ));
    }
    let clip_high = s.eps_clip_high.unwrap_or(s.eps_clip);
    for (flag, value) in [("eps-clip", s.eps_clip), ("eps-clip-high", clip_high)] {
        if !(value.is_finite() && value > 0.0) {
            refuse(format!("--{flag} must be a number above 0 (got {value})"));
        }
    }
    if s.eps_clip >= 1.0 {
        refuse(format!(
            "--eps-clip {} must be below 1: the ratio is held at 1 - eps-clip",
            s.eps_clip
        ));
    }
    let k = s.kl_loss_coef;
    if !(k.is_finite() && k >= 0.0) {
        refuse(format!(
            "--kl-loss-coef must be a number at least 0 (got {k})"
        ));
    }
    if s.use_kl_loss && k == 0.0 {
        tracing::warn!(
            "--use-kl-loss with --kl-loss-coef 0: the KL is measured but does not train"
        );
    }
    let c = s.clip_grad;
    if !(c.is_finite() && c >= 0.0) {
        refuse(format!(
            "--clip-grad must be a number at least 0, 0 never clips (got {c})"
        ));
    }
    let p = s.rollout_top_p;
    if !(p > 0.0 && p <= 1.0) {
        refuse(format!(
            "--rollout-top-p must be above 0 and at most 1 (got {p})"
        ));
    }
    let t = s.eval_temperature;
    if !(t.is_finite() && t >= 0.0) {
        refuse(format!(
            "--eval-temperature must be a number at least 0, 0 is greedy (got {t})"
        ));
    }
    match (&s.eval_prompt_data, s.eval_interval) {
        (Some(_), None) => {
            refuse("--eval-prompt-data needs --eval-interval N (evaluate every N steps)".into())
        }
        (None, Some(_)) => refuse("--eval-interval needs --eval-prompt-data FILE".into()),
        (_, Some(0)) => refuse("--eval-interval must be at least 1 (got 0)".into()),
        _ => {}
    }
    if s.eval_prompt_data.is_some() && s.custom_rm_command.is_none() && s.label_key.is_none() {
        refuse("--eval-prompt-data is scored by a built-in reward against its labels; add --label-key KEY".into());
    }
    let m = s.min_lr;
    if !(m.is_finite() && m >= 0.0 && m <= s.lr) {
        refuse(format!(
            "--min-lr must lie between 0 and --lr {} (got {m})",
            s.lr
        ));
    }
    if s.lr_decay_iters == Some(0) {
        refuse("--lr-decay-iters must be at least 1 (got 0)".into());
    }
    if s.rollout_stop.iter().any(String::is_empty) {
        refuse("--rollout-stop holds an empty string, which would end every sample at its first token; give non-empty strings".into());
    }
    if s.input_key.is_empty() {
        refuse("--input-key must name a field of the rows (got an empty name)".into());
    }
    errors
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::config::RmType;

    fn messages(s: &Settings) -> Vec<String> {
        check(s).iter().map(ToString::to_string).collect()
    }

    #[test]
    fn defaults_break_no_rule_of_the_algorithm() {
        assert!(check(&Settings::default()).is_empty());
    }

    #[test]
    fn warm_up_on_a_dataset_needs_its_labels() {
        let s = Settings {
            prompt_data: Some(PathBuf::from("d.jsonl")),
            sft_warmup_steps: 2,
            custom_rm_command: Some("python3 rm.py".into()),
            ..Settings::default()
        };
        let m = messages(&s);
        assert!(m.len() == 1 && m[0].contains("--label-key"), "{m:?}");
        let labelled = Settings {
            label_key: Some("a".into()),
            ..s
        };
        assert!(check(&labelled).is_empty());
    }

    #[test]
    fn a_dataset_needs_a_reward_and_a_built_in_reward_its_labels() {
        let data = Settings {
            prompt_data: Some(PathBuf::from("d.jsonl")),
            ..Settings::default()
        };
        let m = messages(&data);
        assert!(m.len() == 1 && m[0].contains("--rm-type"), "{m:?}");
        let math = Settings {
            rm_type: Some(RmType::Math),
            ..data.clone()
        };
        let m = messages(&math);
        assert!(m.len() == 1 && m[0].contains("--label-key"), "{m:?}");
        let command = Settings {
            custom_rm_command: Some("python3 rm.py".into()),
            ..data
        };
        assert!(check(&command).is_empty());
        let bad_timeout = Settings {
            custom_rm_timeout: 0.0,
            ..command
        };
        assert!(messages(&bad_timeout)[0].contains("--custom-rm-timeout"));
    }
}
