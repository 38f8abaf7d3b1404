//! `ucs_status_t`: every code UCX defines, with its name.

use std::borrow::Cow;
use std::fmt;

/// A raw UCX status (`ucs_status_t`, a signed 8-bit enum in C).
///
/// Codes in the link-failure (-40..=-59) and endpoint-failure (-60..=-89)
/// ranges are valid UCX statuses even where UCX gives them no name of their
/// own; they keep their raw value.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct UcsStatus(i8);

crate::status_table! { UcsStatus, "UCS_", {
    OK = 0,
    INPROGRESS = 1,
    ERR_NO_MESSAGE = -1,
    ERR_NO_RESOURCE = -2,
    ERR_IO_ERROR = -3,
    ERR_NO_MEMORY = -4,
    ERR_INVALID_PARAM = -5,
    ERR_UNREACHABLE = -6,
    ERR_INVALID_ADDR = -7,
    ERR_NOT_IMPLEMENTED = -8,
    ERR_MESSAGE_TRUNCATED = -9,
    ERR_NO_PROGRESS = -10,
    ERR_BUFFER_TOO_SMALL = -11,
    ERR_NO_ELEM = -12,
    ERR_SOME_CONNECTS_FAILED = -13,
    ERR_NO_DEVICE = -14,
    ERR_BUSY = -15,
    ERR_CANCELED = -16,
    ERR_SHMEM_SEGMENT = -17,
    ERR_ALREADY_EXISTS = -18,
    ERR_OUT_OF_RANGE = -19,
    ERR_TIMED_OUT = -20,
    ERR_EXCEEDS_LIMIT = -21,
    ERR_UNSUPPORTED = -22,
    ERR_REJECTED = -23,
    ERR_NOT_CONNECTED = -24,
    ERR_CONNECTION_RESET = -25,
    ERR_FIRST_LINK_FAILURE = -40,
    ERR_LAST_LINK_FAILURE = -59,
    ERR_FIRST_ENDPOINT_FAILURE = -60,
    ERR_ENDPOINT_TIMEOUT = -80,
    ERR_LAST_ENDPOINT_FAILURE = -89,
    ERR_LAST = -100,
}}

impl UcsStatus {
    /// Wraps a raw `ucs_status_t` value.
    pub const fn from_raw(raw: i8) -> Self {
        UcsStatus(raw)
    }

    /// The raw `ucs_status_t` value.
    pub const fn raw(self) -> i8 {
        self.0
    }

    /// The UCX name, `UCS_ERR_LINK_FAILURE` / `UCS_ERR_ENDPOINT_FAILURE` for
    /// unnamed codes inside those ranges, `UCS_ERR_UNKNOWN` otherwise.
    pub const fn name(self) -> &'static str {
        match self.known_name() {
            Some(n) => n,
            None if self.0 <= -40 && self.0 > -60 => "UCS_ERR_LINK_FAILURE",
            None if self.0 <= -60 && self.0 > -90 => "UCS_ERR_ENDPOINT_FAILURE",
            None => "UCS_ERR_UNKNOWN",
        }
    }

    /// `UCS_OK` or `UCS_INPROGRESS`.
    pub const fn is_ok(self) -> bool {
        self.0 >= 0
    }
}

/// UCX's own text for each named status (`ucs_status_string`), identical in
/// UCX 1.13.1 and 1.23.0. Codes without an entry read "Unknown error <code>".
const MESSAGES: &[(i8, &str)] = &[
    (0, "Success"),
    (1, "Operation in progress"),
    (-1, "No pending message"),
    (-2, "No resources are available to initiate the operation"),
    (-3, "Input/output error"),
    (-4, "Out of memory"),
    (-5, "Invalid parameter"),
    (-6, "Destination is unreachable"),
    (-7, "Address not valid"),
    (-8, "Function not implemented"),
    (-9, "Message truncated"),
    (-10, "No progress"),
    (-11, "Provided buffer is too small"),
    (-12, "No such element"),
    (-13, "Failed to connect some of the requested endpoints"),
    (-14, "No such device"),
    (-15, "Device is busy"),
    (-16, "Request canceled"),
    (-17, "Shared memory error"),
    (-18, "Element already exists"),
    (-19, "Index out of range"),
    (-20, "Operation timed out"),
    (-21, "User-defined limit was reached"),
    (-22, "Unsupported operation"),
    (-23, "Operation rejected by remote peer"),
    (-24, "Endpoint is not connected"),
    (-25, "Connection reset by remote peer"),
    (-80, "Endpoint timeout"),
];

impl UcsStatus {
    /// UCX's own text for this status, where UCX has one of its own
    /// (`Connection reset by remote peer`); `None` for the unnamed codes
    /// (link and endpoint failure ranges other than -80, `UCS_ERR_LAST`).
    pub const fn known_message(self) -> Option<&'static str> {
        let mut i = 0;
        while i < MESSAGES.len() {
            if MESSAGES[i].0 == self.0 {
                return Some(MESSAGES[i].1);
            }
            i += 1;
        }
        None
    }

    /// What `ucs_status_string` returns for this status:
    /// [`known_message`](Self::known_message), or `Unknown error <code>`.
    pub fn message(self) -> Cow<'static, str> {
        match self.known_message() {
            Some(m) => Cow::Borrowed(m),
            None => Cow::Owned(format!("Unknown error {}", self.0)),
        }
    }
}

impl fmt::Debug for UcsStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({})", self.name(), self.0)
    }
}

impl fmt::Display for UcsStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}
