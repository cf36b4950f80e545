//! `Shared<'a, T>`: a value either borrowed for `'a` or shared through an `Arc` (then `'static`), so one API serves scoped callers and threads alike.

use std::ops::Deref;
use std::sync::Arc;

/// Borrowed (`&'a T`) or reference-counted (`Arc<T>`, usable as `Shared<'static, T>` across
/// threads and inside actors). Cheap to clone; derefs to `T`.
#[derive(Debug)]
pub enum Shared<'a, T> {
    Borrowed(&'a T),
    Owned(Arc<T>),
}

impl<T> Clone for Shared<'_, T> {
    fn clone(&self) -> Self {
        match self {
            Shared::Borrowed(t) => Shared::Borrowed(t),
            Shared::Owned(t) => Shared::Owned(Arc::clone(t)),
        }
    }
}

impl<T> Deref for Shared<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        match self {
            Shared::Borrowed(t) => t,
            Shared::Owned(t) => t,
        }
    }
}

impl<'a, T> From<&'a T> for Shared<'a, T> {
    fn from(t: &'a T) -> Self {
        Shared::Borrowed(t)
    }
}

impl<T> From<Arc<T>> for Shared<'static, T> {
    fn from(t: Arc<T>) -> Self {
        Shared::Owned(t)
    }
}

impl<'a, T> From<&'a Arc<T>> for Shared<'static, T> {
    fn from(t: &'a Arc<T>) -> Self {
        Shared::Owned(Arc::clone(t))
    }
}
