//! Result buffers of the collectives, and the frames the TCP transport receives. Results that
//! every rank receives identically (all-gather, broadcast) are held once, in a buffer all ranks'
//! tensors view; burn copies such a buffer on the first in-place write (`Bytes::from_shared` is
//! copy-on-write), so ranks never see each other's changes. Fresh buffers come from a small
//! pool, so that once warm, a training step that repeats the same calls allocates nothing.

use std::alloc::{Layout, alloc_zeroed, handle_alloc_error};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use burn::tensor::{AllocationProperty, Bytes, DType, TensorData};

use crate::sync::lock;

/// A buffer that ranks fill in disjoint parts during a call and all read afterwards.
#[derive(Clone)]
pub(crate) struct SharedBuffer {
    memory: Arc<dyn Memory>,
    /// Where ranks write their parts (null for a shared input nobody writes); valid while
    /// `memory` is alive.
    ptr: *mut u8,
}

impl std::fmt::Debug for SharedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBuffer({} bytes)", self.memory.len())
    }
}

// SAFETY: ranks write disjoint parts through `ptr` during a call, and read only after every
// write is done (the rendezvous' last phase orders them).
unsafe impl Send for SharedBuffer {}

trait Memory: Send + Sync {
    fn ptr(&self) -> *const u8;
    /// Where ranks may write; only fresh memory has one.
    fn ptr_mut(&self) -> *mut u8 {
        std::ptr::null_mut()
    }
    fn len(&self) -> usize;
}

/// Fresh memory, written by the ranks before anyone reads it. Held as a raw pointer, so that
/// writing through pointers derived from it is allowed; it is a `Words` box again on drop.
struct Fresh {
    words: NonNull<[u128]>,
    len: usize,
}

// SAFETY: `Fresh` owns its allocation like the `Box` it came from.
unsafe impl Send for Fresh {}
unsafe impl Sync for Fresh {}

/// Memory of a buffer. Every byte is initialised (zeroed when allocated, written since), so a
/// buffer may be read into through a slice whatever it held before.
type Words = Box<[u128]>;

// Buffers are 16-byte aligned (burn's largest alignment) because their words are.
const _: () = assert!(std::mem::align_of::<u128>() == 16);

/// Freed buffers kept for reuse, as a caching allocator does: training repeats the same sizes
/// every step, and fresh large allocations cost a page fault per page (and `munmap` on free),
/// which is slower than the copy itself.
static POOL: Mutex<Pool> = Mutex::new(Pool::new(1 << 30));

struct Pool {
    /// The oldest first: they go first when the pool is full.
    buffers: Vec<Words>,
    /// Bytes of `buffers`, kept so that a return does not add them up.
    bytes: usize,
    /// At most this many bytes are kept.
    limit: usize,
}

impl Pool {
    const fn new(limit: usize) -> Self {
        Self {
            buffers: Vec::new(),
            bytes: 0,
            limit,
        }
    }

    /// The smallest kept buffer of at least `words` words that wastes at most half of itself.
    fn take(&mut self, words: usize) -> Option<Words> {
        let buffers = &self.buffers;
        let best = (0..buffers.len())
            .filter(|&i| buffers[i].len() >= words && buffers[i].len() <= 2 * words)
            .min_by_key(|&i| buffers[i].len())?;
        let taken = self.buffers.remove(best);
        self.bytes -= taken.len() * 16;
        Some(taken)
    }

    /// Keeps `words`, letting the oldest buffers go when full (sizes no longer asked for):
    /// returns those to free, which the caller does after the lock.
    fn keep(&mut self, words: Words) -> Vec<Words> {
        let size = words.len() * 16;
        if size > self.limit {
            return vec![words];
        }
        let mut evicted = Vec::new();
        while self.bytes + size > self.limit {
            let oldest = self.buffers.remove(0);
            self.bytes -= oldest.len() * 16;
            evicted.push(oldest);
        }
        self.bytes += size;
        self.buffers.push(words);
        evicted
    }
}

/// `words` words, kept or fresh; none if memory is short.
fn take_words(words: usize) -> Option<Words> {
    if words == 0 {
        return zeroed(0);
    }
    let kept = lock(&POOL).take(words);
    kept.or_else(|| zeroed(words))
}

/// `words` zeroed words, or none if memory is short. Only a pool miss pays for the zeroing, and
/// for memory the allocator maps fresh (large sizes) the OS's pages are zero already.
fn zeroed(words: usize) -> Option<Words> {
    if words == 0 {
        return Some(Box::new([]));
    }
    let layout = Layout::array::<u128>(words).ok()?;
    // SAFETY: the layout is not empty.
    let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })?;
    let slice = std::ptr::slice_from_raw_parts_mut(ptr.as_ptr().cast::<u128>(), words);
    // SAFETY: allocated by the global allocator with the layout of `words` words.
    Some(unsafe { Box::from_raw(slice) })
}

impl Drop for Fresh {
    fn drop(&mut self) {
        // SAFETY: `words` came from `Box::leak` and is not used after this.
        let words = unsafe { Box::from_raw(self.words.as_ptr()) };
        if !words.is_empty() {
            let evicted = lock(&POOL).keep(words);
            drop(evicted);
        }
    }
}

impl Memory for Fresh {
    fn ptr(&self) -> *const u8 {
        self.words.as_ptr() as *const u8
    }
    fn ptr_mut(&self) -> *mut u8 {
        self.words.as_ptr() as *mut u8
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A rank's own buffer, handed over to be shared.
struct Owned(Bytes);

impl Memory for Owned {
    fn ptr(&self) -> *const u8 {
        self.0.as_ptr()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}

/// One rank's read-only view; created only once the buffer is fully written.
struct View(Arc<dyn Memory>);

impl AsRef<[u8]> for View {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: views are made after every byte was written, and nobody writes afterwards.
        unsafe { std::slice::from_raw_parts(self.0.ptr(), self.0.len()) }
    }
}

impl SharedBuffer {
    /// `len` bytes, 16-byte aligned, of no particular value (zeros, or what a freed buffer
    /// held): the call must write every byte.
    pub fn uninit(len: usize) -> Self {
        Self::try_uninit(len).unwrap_or_else(|| {
            let words = Layout::array::<u128>(len.div_ceil(16)).expect("capacity overflow");
            handle_alloc_error(words)
        })
    }

    /// As [`SharedBuffer::uninit`], or none if memory is short (a length read off the wire).
    pub fn try_uninit(len: usize) -> Option<Self> {
        let memory = Fresh {
            words: NonNull::from(Box::leak(take_words(len.div_ceil(16))?)),
            len,
        };
        let ptr = memory.ptr_mut();
        Some(Self {
            memory: Arc::new(memory),
            ptr,
        })
    }

    /// The whole buffer, to be written. Its bytes are initialised (fresh memory is zeroed).
    ///
    /// # Safety
    /// Nobody else reads or writes the buffer while the slice lives.
    pub unsafe fn bytes_mut(&mut self) -> &mut [u8] {
        assert!(!self.ptr.is_null(), "a shared input is not written");
        // SAFETY: `ptr` holds `len` initialised bytes, and the caller has them to itself.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len()) }
    }

    /// Shares `data`'s buffer as it is, without a copy. Nobody writes to it.
    pub fn from_data(data: TensorData) -> Self {
        let memory = Owned(data.bytes);
        let ptr = memory.ptr_mut();
        Self {
            memory: Arc::new(memory),
            ptr,
        }
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.memory.len()
    }

    /// One rank's view of the result, once every byte of it has been written.
    pub fn view(&self, shape: impl Into<burn::tensor::Shape>, dtype: DType) -> TensorData {
        let shared = bytes::Bytes::from_owner(View(self.memory.clone()));
        let bytes = Bytes::from_shared(shared, AllocationProperty::Native);
        TensorData::from_bytes(bytes, shape, dtype)
    }
}

impl crate::transport::Footprint for SharedBuffer {
    fn footprint(&self) -> usize {
        self.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_result_is_reused() {
        // An odd size no other test asks for, so the pool hands this very buffer back.
        let len = 3_333_331;
        let first = SharedBuffer::uninit(len);
        let ptr = first.ptr();
        // SAFETY: every byte is written before the view is made.
        unsafe { std::ptr::write_bytes(ptr, 7, len) };
        let view = first.view(vec![len], DType::U8);
        drop(first);
        assert_eq!(view.as_bytes()[len - 1], 7);
        drop(view);
        let second = SharedBuffer::uninit(len);
        assert_eq!(second.ptr(), ptr);
    }

    #[test]
    fn a_full_pool_lets_its_oldest_buffers_go_and_keeps_none_too_large() {
        let words = |n: usize| zeroed(n).unwrap();
        let mut pool = Pool::new(10 * 16);
        assert!(pool.keep(words(4)).is_empty());
        assert!(pool.keep(words(3)).is_empty());
        // 4 + 3 + 5 words is more than 10: the oldest (4) goes.
        let evicted = pool.keep(words(5));
        assert_eq!(evicted.iter().map(|w| w.len()).collect::<Vec<_>>(), [4]);
        assert_eq!(pool.bytes, 8 * 16);
        assert_eq!(pool.keep(words(11)).len(), 1, "larger than the whole pool");
        // 3 is the smallest that fits 2 words; 5 would waste more than half of itself.
        assert_eq!(pool.take(2).map(|w| w.len()), Some(3));
        assert!(pool.take(2).is_none());
        assert_eq!(pool.take(5).map(|w| w.len()), Some(5));
        assert_eq!((pool.bytes, pool.buffers.len()), (0, 0));
    }
}
