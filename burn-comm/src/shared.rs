//! Result buffers of the collectives. Results that every rank receives identically
//! (all-gather, broadcast) are held once, in a buffer all ranks' tensors view; burn copies such
//! a buffer on the first in-place write (`Bytes::from_shared` is copy-on-write), so ranks never
//! see each other's changes. Fresh buffers come from a small pool, so that once warm, a training
//! step that repeats the same calls allocates nothing.

use std::alloc::{Layout, alloc_zeroed, handle_alloc_error};
use std::mem::MaybeUninit;
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
    words: NonNull<[MaybeUninit<u128>]>,
    len: usize,
}

// SAFETY: `Fresh` owns its allocation like the `Box` it came from.
unsafe impl Send for Fresh {}
unsafe impl Sync for Fresh {}

type Words = Box<[MaybeUninit<u128>]>;

/// Freed result buffers kept for reuse, as a caching allocator does: training repeats the same
/// sizes every step, and fresh large allocations cost a page fault per page (and `munmap` on
/// free), which is slower than the copy itself.
static POOL: Mutex<Pool> = Mutex::new(Pool {
    buffers: Vec::new(),
    bytes: 0,
});
/// At most this many bytes are kept.
const POOL_BYTES: usize = 1 << 30;

struct Pool {
    buffers: Vec<Words>,
    /// Bytes of `buffers`, kept so that a return does not add them up.
    bytes: usize,
}

/// `words` words, kept or fresh; none if memory is short.
fn take_words(words: usize) -> Option<Words> {
    let mut pool = lock(&POOL);
    let buffers = &pool.buffers;
    // The smallest kept buffer that fits without wasting more than half of it.
    let best = (0..buffers.len())
        .filter(|&i| buffers[i].len() >= words && buffers[i].len() <= 2 * words.max(1))
        .min_by_key(|&i| buffers[i].len());
    match best {
        Some(i) => {
            let taken = pool.buffers.swap_remove(i);
            pool.bytes -= taken.len() * 16;
            Some(taken)
        }
        None => {
            drop(pool);
            zeroed(words)
        }
    }
}

/// `words` zeroed words, or none if memory is short. Zeroed, so that every byte of a buffer is
/// initialised and may be read into through a slice; large requests get fresh pages from the
/// OS, which are zero already (`calloc`), so this costs nothing on top of the page faults.
fn zeroed(words: usize) -> Option<Words> {
    if words == 0 {
        return Some(Box::new([]));
    }
    let layout = Layout::array::<u128>(words).ok()?;
    // SAFETY: the layout is not empty.
    let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })?;
    let slice = std::ptr::slice_from_raw_parts_mut(ptr.as_ptr().cast::<MaybeUninit<u128>>(), words);
    // SAFETY: allocated by the global allocator with the layout of `words` words.
    Some(unsafe { Box::from_raw(slice) })
}

impl Drop for Fresh {
    fn drop(&mut self) {
        // SAFETY: `words` came from `Box::leak` and is not used after this.
        let words = unsafe { Box::from_raw(self.words.as_ptr()) };
        let mut pool = lock(&POOL);
        if pool.bytes + words.len() * 16 <= POOL_BYTES {
            pool.bytes += words.len() * 16;
            pool.buffers.push(words);
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
    /// `len` bytes, 16-byte aligned, of no particular value: the call must write every byte.
    pub fn uninit(len: usize) -> Self {
        Self::try_uninit(len).unwrap_or_else(|| {
            let words = Layout::array::<u128>(len.div_ceil(16));
            handle_alloc_error(words.unwrap_or(Layout::new::<u128>()))
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
}
