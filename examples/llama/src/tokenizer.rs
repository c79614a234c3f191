//! Text to token ids and back with a Hugging Face `tokenizer.json` (the `tokenizers` crate,
//! the Rust core of transformers' fast tokenizers, so ids are the ones transformers gives).

use std::path::{Path, PathBuf};

/// A `tokenizer.json`, loaded.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    /// One more than its largest id (the crate's own count is of tokens, which is less when
    /// ids leave gaps).
    vocab_size: usize,
}

impl TextTokenizer {
    /// Loads `path`.
    pub fn open(path: &Path) -> Result<Self, String> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| format!("cannot load the tokenizer {}: {e}", path.display()))?;
        let vocab_size = inner
            .get_vocab(true)
            .into_values()
            .max()
            .map_or(0, |id| id as usize + 1);
        Ok(Self {
            inner,
            path: path.to_path_buf(),
            vocab_size,
        })
    }

    /// Where it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One more than the largest id it can give, special tokens included: the model's
    /// vocabulary must hold them all.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Whether text cut at a line's end gets the ids of the whole: false for a tokenizer that
    /// prepends something to every text it is given (SentencePiece's `▁`).
    pub fn cuts_cleanly(&self) -> Result<bool, String> {
        let whole = self.encode("ab\ncd", false)?;
        let mut parts = self.encode("ab\n", false)?;
        parts.extend(self.encode("cd", false)?);
        Ok(whole == parts)
    }

    /// Refuses a model whose vocabulary is smaller than this tokenizer's.
    pub fn check_fits(&self, model_vocab: usize) -> Result<(), String> {
        if self.vocab_size() > model_vocab {
            return Err(format!(
                "the tokenizer {} gives {} ids, but the model's vocabulary has {model_vocab}; use the model's own tokenizer",
                self.path.display(),
                self.vocab_size()
            ));
        }
        Ok(())
    }

    /// The ids of `text`; `special` adds what the tokenizer adds around a text on its own
    /// (Llama 3's begin-of-text), as transformers' `tokenizer(text)` does.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, String> {
        let encoding = self.inner.encode(text, special).map_err(|e| {
            format!(
                "the tokenizer {} failed on a text: {e}",
                self.path.display()
            )
        })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.inner.decode(ids, true).map_err(|e| {
            format!(
                "the tokenizer {} failed to decode: {e}",
                self.path.display()
            )
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::Value;

    /// The fixture's directory (`scripts/make_tokenizer_fixture.py` wrote it with Hugging
    /// Face's Python package).
    pub(crate) fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
    }

    #[test]
    fn ids_are_the_python_packages_and_decode_back_to_the_text() {
        let tokenizer = TextTokenizer::open(&fixture().join("tokenizer.json")).unwrap();
        let text = std::fs::read_to_string(fixture().join("expected.json")).unwrap();
        let expected: Value = serde_json::from_str(&text).unwrap();
        let ids =
            |key: &str| -> Vec<u32> { serde_json::from_value(expected[key].clone()).unwrap() };
        let sample = expected["text"].as_str().unwrap();
        assert_eq!(tokenizer.vocab_size(), expected["vocab_size"]);
        assert_eq!(tokenizer.encode(sample, false).unwrap(), ids("ids"));
        assert_eq!(
            tokenizer.encode(sample, true).unwrap(),
            ids("ids_with_special_tokens")
        );
        assert_eq!(tokenizer.decode(&ids("ids")).unwrap(), sample);
        assert_eq!(
            tokenizer.decode(&ids("ids_with_special_tokens")).unwrap(),
            sample
        );
        assert!(tokenizer.check_fits(320).is_ok());
        let error = tokenizer.check_fits(256).unwrap_err();
        assert!(error.contains("gives 320 ids"), "{error}");
        let error = TextTokenizer::open(&fixture().join("expected.json"))
            .err()
            .unwrap();
        assert!(error.contains("cannot load the tokenizer"), "{error}");
    }
}
