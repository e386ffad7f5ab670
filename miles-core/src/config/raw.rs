//! Settings as typed or read: every value optional, nothing checked yet.

use std::path::Path;

use super::{ConfigError, RawSettings};
use crate::choice::nearest;

impl RawSettings {
    /// Reads a TOML config file.
    ///
    /// # Errors
    /// [`ConfigError::ReadFile`] when the file cannot be read, [`ConfigError::UnknownKey`] for a
    /// key no setting has, [`ConfigError::Parse`] for invalid TOML or a value of the wrong type.
    pub fn from_toml_file(path: &Path) -> Result<RawSettings, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
            path: path.to_path_buf(),
            source,
        })?;
        RawSettings::from_toml_str(&text, path)
    }

    /// Parses TOML text; `origin` names it in errors.
    ///
    /// # Errors
    /// As [`RawSettings::from_toml_file`], without the read.
    pub fn from_toml_str(text: &str, origin: &Path) -> Result<RawSettings, ConfigError> {
        toml::from_str(text).map_err(|error| {
            let span = error.span();
            let before = span.as_ref().and_then(|span| text.get(..span.start));
            let line = before.map_or(0, |before| before.matches('\n').count() + 1);
            let spanned = span.and_then(|span| text.get(span)).unwrap_or_default();
            let key = spanned.trim().trim_matches(|c| c == '"' || c == '\'');
            if error.message().starts_with("unknown field") && !key.is_empty() {
                let keys = RawSettings::keys();
                let candidates: Vec<&str> = keys.iter().map(String::as_str).collect();
                ConfigError::UnknownKey {
                    origin: origin.to_path_buf(),
                    key: key.to_owned(),
                    line,
                    suggestion: nearest(key, &candidates).map(str::to_owned),
                }
            } else {
                ConfigError::Parse {
                    origin: origin.to_path_buf(),
                    line,
                    message: error.message().trim().to_owned(),
                }
            }
        })
    }

    /// Every key a config file may hold, sorted.
    pub fn keys() -> Vec<String> {
        let mut keys: Vec<String> = super::FIELDS.iter().map(|f| f.key.to_owned()).collect();
        keys.sort();
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TrainBackendKind;

    fn parse(text: &str) -> Result<RawSettings, ConfigError> {
        RawSettings::from_toml_str(text, Path::new("test.toml"))
    }

    #[test]
    fn keys_list_every_field_of_a_layer() {
        let keys = RawSettings::keys();
        assert_eq!(keys.len(), super::super::FIELDS.len());
        for key in [
            "offload",
            "offload_train",
            "offload_rollout_level",
            "memory_timeline",
        ] {
            assert!(keys.iter().any(|k| k == key), "{key} missing from {keys:?}");
        }
    }

    #[test]
    fn toml_keys_with_underscores_fill_the_layer() {
        let raw = parse(
            "train_backend = \"fsdp\"\ncolocate = true\noffload_rollout_level = [\"weight\"]\n\
             offload_train_disk_chunk_mb = 16\nlr = 3e-4\n",
        )
        .unwrap();
        assert_eq!(raw.train_backend, Some(TrainBackendKind::Fsdp));
        assert_eq!(raw.colocate, Some(true));
        assert_eq!(raw.offload_rollout_level, Some(vec!["weight".to_owned()]));
        assert_eq!(raw.offload_train_disk_chunk_mb, Some(16));
        assert_eq!(raw.lr, Some(3e-4));
        assert_eq!(raw.offload_train, None);
    }

    #[test]
    fn unknown_key_names_the_key_the_line_and_a_suggestion() {
        let error = parse("colocate = true\n\noffload_trian = true\n").unwrap_err();
        match &error {
            ConfigError::UnknownKey {
                key,
                line,
                suggestion,
                ..
            } => {
                assert_eq!(key, "offload_trian");
                assert_eq!(*line, 3);
                assert_eq!(suggestion.as_deref(), Some("offload_train"));
            }
            other => panic!("expected UnknownKey, got {other:?}"),
        }
        let message = error.to_string();
        assert!(
            message.contains("`offload_trian`") && message.contains("line 3"),
            "{message}"
        );
    }

    #[test]
    fn wrong_value_type_and_bad_enum_name_are_parse_errors_with_the_line() {
        let error = parse("steps = 3\ncolocate = \"yes\"\n").unwrap_err();
        assert!(
            matches!(error, ConfigError::Parse { line: 2, .. }),
            "{error:?}"
        );
        let error = parse("train_backend = \"fsdpp\"\n").unwrap_err();
        assert!(
            matches!(error, ConfigError::Parse { line: 1, .. }),
            "{error:?}"
        );
        assert!(
            error.to_string().contains("did you mean `fsdp`?"),
            "{error}"
        );
    }

    #[test]
    fn missing_file_is_a_read_error() {
        let dir = tempfile::tempdir().unwrap();
        let error = RawSettings::from_toml_file(&dir.path().join("absent.toml")).unwrap_err();
        assert!(matches!(error, ConfigError::ReadFile { .. }));
    }
}
