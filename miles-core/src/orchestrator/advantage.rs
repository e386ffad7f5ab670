//! Advantages from rewards: group-normalised (GRPO) or against a learned value baseline (PPO).
//!
//! Rewards and advantages are laid out by prompt, then sample: entry `i * n + j` is sample `j`
//! of prompt `i`.

/// Added to the standard deviation of a group so that a group of equal rewards gets zero
/// advantages rather than a division by zero.
pub const GRPO_EPS: f32 = 1e-6;

/// GRPO advantages: within each group of `n` samples of one prompt,
/// `(r - mean) / (std + eps)` with the population standard deviation.
///
/// A group whose rewards are all equal teaches nothing and gets zeros.
pub fn grpo_advantages(rewards: &[f32], n: usize) -> Vec<f32> {
    let n = n.max(1);
    rewards
        .chunks(n)
        .flat_map(|group| {
            let (mean, std) = mean_std(group);
            group.iter().map(move |r| (r - mean) / (std + GRPO_EPS))
        })
        .collect()
}

/// REINFORCE++ advantages: every reward normalised over the whole rollout,
/// `(r - mean) / (std + eps)`, so that prompts share one baseline.
pub fn reinforce_plus_plus_advantages(rewards: &[f32]) -> Vec<f32> {
    let (mean, std) = mean_std(rewards);
    rewards
        .iter()
        .map(|r| (r - mean) / (std + GRPO_EPS))
        .collect()
}

/// Mean and population standard deviation (both 0 for an empty slice).
pub fn mean_std(values: &[f32]) -> (f32, f32) {
    if values.is_empty() {
        return (0.0, 0.0);
    }
    let count = values.len() as f64;
    let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / count;
    let var = values
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / count;
    (mean as f32, var.sqrt() as f32)
}

/// PPO advantages `reward - value` of each sample, with `values` one per prompt, and the value
/// targets (the rewards) of each sample's prompt.
pub fn ppo_advantages(rewards: &[f32], values: &[f32], n: usize) -> Vec<f32> {
    let n = n.max(1);
    rewards
        .chunks(n)
        .zip(values)
        .flat_map(|(group, &value)| group.iter().map(move |r| r - value))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpo_normalises_each_group_on_its_own() {
        let rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.25, 0.75];
        let adv = grpo_advantages(&rewards, 4);
        // Group 1: mean 0.5, std 0.5.
        let expected = [1.0, -1.0, -1.0, 1.0];
        // Group 2: mean 0.5, std sqrt(0.03125).
        let s = 0.03125f32.sqrt();
        let expected2 = [0.0, 0.0, -0.25 / s, 0.25 / s];
        let worst = adv
            .iter()
            .zip(expected.iter().chain(&expected2))
            .map(|(a, e)| (a - e).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "worst difference {worst} (tolerance 1e-4)");
        for group in adv.chunks(4) {
            assert!(group.iter().sum::<f32>().abs() < 1e-5);
        }
    }

    #[test]
    fn grpo_gives_zeros_to_a_group_of_equal_rewards() {
        assert_eq!(grpo_advantages(&[0.7, 0.7, 0.7], 3), vec![0.0; 3]);
    }

    #[test]
    fn reinforce_plus_plus_normalises_over_the_whole_rollout() {
        // Mean 0.5, std 0.5 over all four, whatever the groups.
        let adv = reinforce_plus_plus_advantages(&[1.0, 1.0, 0.0, 0.0]);
        let expected = [1.0, 1.0, -1.0, -1.0];
        let worst = adv
            .iter()
            .zip(expected)
            .map(|(a, e)| (a - e).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst < 1e-4,
            "worst difference {worst} (tolerance 1e-4): {adv:?}"
        );
        // GRPO would give the first group zeros; the shared baseline does not.
        assert_eq!(grpo_advantages(&[1.0, 1.0, 0.0, 0.0], 2), vec![0.0; 4]);
    }

    #[test]
    fn ppo_subtracts_each_prompt_value_from_its_samples_rewards() {
        let adv = ppo_advantages(&[1.0, 0.0, 0.5, 0.25], &[0.25, 0.5], 2);
        assert_eq!(adv, vec![0.75, -0.25, 0.0, -0.25]);
    }

    #[test]
    fn mean_and_population_std_of_known_values() {
        let (mean, std) = mean_std(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert!((mean - 5.0).abs() < 1e-6 && (std - 2.0).abs() < 1e-6);
        assert_eq!(mean_std(&[]), (0.0, 0.0));
    }
}
