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
/// Changes whenever the ids a text gets could change, so older caches are not read.
const VERSION: &[u8] = b"tokenize-2: cut after a newline before a non-space";
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
    let cache = cache_path(path, key(&spec, &text));
    let vocab = tokenizer.vocab_size() as u32;
    if let Some(ids) = read(&cache).filter(|ids| ids.iter().all(|&id| id < vocab)) {
        return Ok(ids);
    }
    let ids = tokenize(&text, tokenizer)?;
    if let Err(e) = write(&cache, &ids) {
        eprintln!("note: the ids are not cached ({e}); the next run tokenizes again");
    }
    Ok(ids)
}

/// The cache's key: this procedure's version, then the tokenizer's and the text's bytes, each
/// after its length so that no two pairs run together alike.
fn key(tokenizer: &[u8], text: &str) -> u64 {
    let (first, second) = (
        (tokenizer.len() as u64).to_le_bytes(),
        (text.len() as u64).to_le_bytes(),
    );
    fnv1a(
        VERSION
            .iter()
            .chain(&first)
            .chain(tokenizer)
            .chain(&second)
            .chain(text.as_bytes()),
    )
}

/// `FILE.<key>.tokens` beside `path`.
pub fn cache_path(path: &Path, key: u64) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{key:016x}.tokens"));
    path.with_file_name(name)
}

/// The text's ids, in chunks cut where a pre-tokenizer splits anyway: after a newline that a
/// non-space character follows (GPT-2's and Llama 3's patterns alike), so the ids are those
/// of the whole text. A tokenizer that prepends something to every text it gets
/// (SentencePiece's `▁`) would differ at each cut, so it gets the whole text at once.
fn tokenize(text: &str, tokenizer: &TextTokenizer) -> Result<Vec<u32>, String> {
    let chunk = if tokenizer.cuts_cleanly()? {
        CHUNK_BYTES
    } else {
        text.len()
    };
    let bar = ProgressBar::new(text.len() as u64).with_style(
        ProgressStyle::with_template("tokenizing {bar:30} {bytes}/{total_bytes} {eta}")
            .expect("a valid template"),
    );
    let mut ids = Vec::with_capacity(text.len() / 3);
    let mut rest = text;
    while !rest.is_empty() {
        let end = cut(rest, chunk);
        ids.extend(tokenizer.encode(&rest[..end], false)?);
        bar.inc(end as u64);
        rest = &rest[end..];
    }
    bar.finish_and_clear();
    Ok(ids)
}

/// Where to cut `text` at or after byte `from`: just after a newline followed by a character
/// that is not white space; the end when there is no such newline.
fn cut(text: &str, from: usize) -> usize {
    let bytes = text.as_bytes();
    (from.min(text.len())..text.len())
        .find(|&i| {
            bytes[i] == b'\n'
                && text[i + 1..]
                    .chars()
                    .next()
                    .is_some_and(|c| !c.is_whitespace())
        })
        .map_or(text.len(), |i| i + 1)
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
    fn chunks_are_cut_only_before_a_line_that_starts_with_text() {
        let text = "ab\n\n\ncd\n  ef\n\tg\nh";
        assert_eq!(
            cut(text, 0),
            5,
            "after the last of the blank lines, before `cd`"
        );
        assert_eq!(cut(text, 5), 16, "not before an indented line: before `h`");
        assert_eq!(cut(text, 17), text.len(), "no newline left");
        assert_eq!(cut(text, 99), text.len());
        assert_eq!(cut("é\nx", 0), 3, "byte offsets, past a two-byte character");
    }

    #[test]
    fn text_is_tokenized_once_then_read_from_its_cache() {
        let dir = std::env::temp_dir().join(format!("llama-token-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let tokenizer = TextTokenizer::open(&fixture().join("tokenizer.json")).unwrap();
        // Longer than a chunk, with lines, so chunks are cut at lines' ends.
        let line = "Every strategy is proven against the single-device run, déjà vu.\n";
        let mut text = line.repeat(CHUNK_BYTES / line.len() - 1);
        // Blank lines and indented lines across the first chunk's end, which a cut inside
        // them would tokenize apart.
        text += &"\n\n\n  indented\n\t\n".repeat(16);
        text += &line.repeat(CHUNK_BYTES / line.len());
        let data = dir.join("corpus.txt");
        std::fs::write(&data, &text).unwrap();
        let ids = tokens(&data, &tokenizer).unwrap();
        assert_eq!(ids, tokenizer.encode(&text, false).unwrap());
        let caches: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(caches.len(), 2, "the data and one cache, no temporary left");
        // The second run reads the cache: tamper with it (keeping it whole) and see.
        let cache = cache_path(&data, key(&std::fs::read(tokenizer.path()).unwrap(), &text));
        write(&cache, &[7, 8, 9]).unwrap();
        assert_eq!(tokens(&data, &tokenizer).unwrap(), vec![7, 8, 9]);
        // Ids the tokenizer cannot give make the cache stale: tokenized again.
        write(&cache, &[7, 8, 320]).unwrap();
        assert_eq!(tokens(&data, &tokenizer).unwrap(), ids);
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
