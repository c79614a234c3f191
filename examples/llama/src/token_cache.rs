//! A text file tokenized once: the ids are kept beside the data in
//! `FILE.<key>.tokens`, the key a hash of the tokenizer and of the text, so a changed file or
//! another tokenizer never reads stale ids.
//!
//! The file: `LLMTOK01`, the id count (u64, little-endian), then the ids (u32, little-endian).
//! It is written to a temporary name and renamed, so a run killed while writing leaves none.

use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};

use crate::model::fnv1a;
use crate::tokenizer::TextTokenizer;

const MAGIC: &[u8; 8] = b"LLMTOK01";
/// Text handed to the tokenizer at once, cut at a line's end.
const CHUNK_BYTES: usize = 1 << 16;

/// The ids of `path`'s text under `tokenizer`, from the cache when it has them, else
/// tokenized (with a progress bar) and cached. A cache that cannot be written is reported on
/// stderr and the run goes on.
pub fn tokens(path: &Path, tokenizer: &TextTokenizer) -> Result<Vec<u32>, String> {
    let text = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let text = String::from_utf8(text).map_err(|e| {
        format!(
            "{} is not UTF-8 text (byte {}); a tokenizer reads text, or drop --tokenizer to train on its bytes",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    let spec = std::fs::read(tokenizer.path())
        .map_err(|e| format!("cannot read {}: {e}", tokenizer.path().display()))?;
    let cache = cache_path(path, fnv1a(spec.iter().chain(text.as_bytes())));
    if let Some(ids) = read(&cache) {
        return Ok(ids);
    }
    let ids = tokenize(&text, tokenizer)?;
    if let Err(e) = write(&cache, &ids) {
        eprintln!("note: the ids are not cached ({e}); the next run tokenizes again");
    }
    Ok(ids)
}

/// `FILE.<key>.tokens` beside `path`.
pub fn cache_path(path: &Path, key: u64) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{key:016x}.tokens"));
    path.with_file_name(name)
}

/// The text's ids, in chunks that end at a line's end (a pre-tokenizer splits there anyway,
/// but for runs of blank lines cut at a chunk's end).
fn tokenize(text: &str, tokenizer: &TextTokenizer) -> Result<Vec<u32>, String> {
    let bar = ProgressBar::new(text.len() as u64).with_style(
        ProgressStyle::with_template("tokenizing {bar:30} {bytes}/{total_bytes} {eta}")
            .expect("a valid template"),
    );
    let mut ids = Vec::with_capacity(text.len() / 3);
    let mut rest = text;
    while !rest.is_empty() {
        let mut end = rest.len().min(CHUNK_BYTES);
        while !rest.is_char_boundary(end) {
            end += 1;
        }
        if let Some(newline) = rest[end..].find('\n') {
            end += newline + 1;
        } else {
            end = rest.len();
        }
        ids.extend(tokenizer.encode(&rest[..end], false)?);
        bar.inc(end as u64);
        rest = &rest[end..];
    }
    bar.finish_and_clear();
    Ok(ids)
}

/// The cached ids, if the file is there and whole.
fn read(cache: &Path) -> Option<Vec<u32>> {
    let bytes = std::fs::read(cache).ok()?;
    let (head, body) = bytes.split_at_checked(16)?;
    let count = u64::from_le_bytes(head[8..].try_into().ok()?) as usize;
    if &head[..8] != MAGIC || body.len() != count.checked_mul(4)? {
        return None;
    }
    Some(
        body.chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("chunks of 4")))
            .collect(),
    )
}

fn write(cache: &Path, ids: &[u32]) -> Result<(), String> {
    let mut bytes = Vec::with_capacity(16 + 4 * ids.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&(ids.len() as u64).to_le_bytes());
    for id in ids {
        bytes.extend_from_slice(&id.to_le_bytes());
    }
    let mut temporary = cache.as_os_str().to_os_string();
    temporary.push(format!(".{}.tmp", std::process::id()));
    let temporary = PathBuf::from(temporary);
    std::fs::write(&temporary, bytes)
        .and_then(|()| std::fs::rename(&temporary, cache))
        .map_err(|e| {
            let _ = std::fs::remove_file(&temporary);
            format!("cannot write {}: {e}", cache.display())
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::fixture;

    #[test]
    fn text_is_tokenized_once_then_read_from_its_cache() {
        let dir = std::env::temp_dir().join(format!("llama-token-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let tokenizer = TextTokenizer::open(&fixture().join("tokenizer.json")).unwrap();
        // Longer than a chunk, with lines, so chunks are cut at lines' ends.
        let line = "Every strategy is proven against the single-device run, déjà vu.\n";
        let text = line.repeat(2 * CHUNK_BYTES / line.len());
        let data = dir.join("corpus.txt");
        std::fs::write(&data, &text).unwrap();
        let ids = tokens(&data, &tokenizer).unwrap();
        assert_eq!(ids, tokenizer.encode(&text, false).unwrap());
        let caches: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(caches.len(), 2, "the data and one cache, no temporary left");
        // The second run reads the cache: tamper with it (keeping it whole) and see.
        let key = fnv1a(
            std::fs::read(tokenizer.path())
                .unwrap()
                .iter()
                .chain(text.as_bytes()),
        );
        let cache = cache_path(&data, key);
        write(&cache, &[7, 8, 9]).unwrap();
        assert_eq!(tokens(&data, &tokenizer).unwrap(), vec![7, 8, 9]);
        // A truncated cache is not trusted: the text is tokenized again and the cache mended.
        let bytes = std::fs::read(&cache).unwrap();
        std::fs::write(&cache, &bytes[..bytes.len() - 1]).unwrap();
        assert_eq!(tokens(&data, &tokenizer).unwrap(), ids);
        assert_eq!(read(&cache).unwrap(), ids);
        // Other text, another key.
        std::fs::write(&data, "other text\n").unwrap();
        assert_eq!(
            tokens(&data, &tokenizer).unwrap(),
            tokenizer.encode("other text\n", false).unwrap()
        );
        std::fs::write(&data, [0xff, 0xfe]).unwrap();
        let error = tokens(&data, &tokenizer).unwrap_err();
        assert!(error.contains("is not UTF-8 text"), "{error}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
