//! The API's one error type: [`ApiError`], a [`Code`] (each with its one
//! status) and a message naming what was wrong, sent as `{"error": {"code",
//! "message", "field"?}}`. Nothing internal is put in a message: a database
//! error is logged and answered `unavailable`.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};

/// Every error code the API answers with; each has one status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Code {
    BacklogFull,
    BadBody,
    BodyTimeout,
    Busy,
    Conflict,
    CrossSite,
    Delivering,
    DeliveryUnknown,
    ToolOutcomeUnknown,
    Draining,
    Finished,
    Invalid,
    InvalidHeader,
    InvalidRequest,
    JobFinished,
    MalformedJson,
    MethodNotAllowed,
    Misdirected,
    NotDead,
    NotFound,
    NotMigrated,
    NotWaiting,
    ScheduleConflict,
    SignalConflict,
    TooLarge,
    TooManySchedules,
    TooManySignals,
    TooManyStreams,
    Unauthorized,
    Unavailable,
    UnsupportedMediaType,
    WaitDecided,
}

impl Code {
    /// The code as the body names it (`snake_case`).
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Code::BacklogFull => "backlog_full",
            Code::BadBody => "bad_body",
            Code::BodyTimeout => "body_timeout",
            Code::Busy => "busy",
            Code::Conflict => "conflict",
            Code::CrossSite => "cross_site",
            Code::Delivering => "delivering",
            Code::DeliveryUnknown => "delivery_unknown",
            Code::ToolOutcomeUnknown => "tool_outcome_unknown",
            Code::Draining => "draining",
            Code::Finished => "finished",
            Code::Invalid => "invalid",
            Code::InvalidHeader => "invalid_header",
            Code::InvalidRequest => "invalid_request",
            Code::JobFinished => "job_finished",
            Code::MalformedJson => "malformed_json",
            Code::MethodNotAllowed => "method_not_allowed",
            Code::Misdirected => "misdirected",
            Code::NotDead => "not_dead",
            Code::NotFound => "not_found",
            Code::NotMigrated => "not_migrated",
            Code::NotWaiting => "not_waiting",
            Code::ScheduleConflict => "schedule_conflict",
            Code::SignalConflict => "signal_conflict",
            Code::TooLarge => "too_large",
            Code::TooManySchedules => "too_many_schedules",
            Code::TooManySignals => "too_many_signals",
            Code::TooManyStreams => "too_many_streams",
            Code::Unauthorized => "unauthorized",
            Code::Unavailable => "unavailable",
            Code::UnsupportedMediaType => "unsupported_media_type",
            Code::WaitDecided => "wait_decided",
        }
    }

    /// The status every answer with this code has.
    pub(crate) fn status(self) -> StatusCode {
        match self {
            Code::BadBody | Code::InvalidHeader | Code::MalformedJson => StatusCode::BAD_REQUEST,
            Code::Unauthorized => StatusCode::UNAUTHORIZED,
            Code::CrossSite => StatusCode::FORBIDDEN,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Code::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Code::Conflict
            | Code::Delivering
            | Code::DeliveryUnknown
            | Code::ToolOutcomeUnknown
            | Code::Finished
            | Code::JobFinished
            | Code::NotDead
            | Code::NotWaiting
            | Code::ScheduleConflict
            | Code::SignalConflict
            | Code::TooManySchedules
            | Code::TooManySignals
            | Code::WaitDecided => StatusCode::CONFLICT,
            Code::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Code::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Code::Misdirected => StatusCode::MISDIRECTED_REQUEST,
            Code::Invalid | Code::InvalidRequest => StatusCode::UNPROCESSABLE_ENTITY,
            Code::BacklogFull | Code::Busy | Code::TooManyStreams => StatusCode::TOO_MANY_REQUESTS,
            Code::Draining | Code::NotMigrated | Code::Unavailable => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }
}

/// Every error answer: `{"error": {"code", "message", "field"?}}`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub(crate) struct ErrorBody {
    pub(crate) error: ErrorDetail,
}

/// What went wrong, with the field at fault when one is.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub(crate) struct ErrorDetail {
    /// A stable code (`invalid`, `not_found`, `conflict`, …).
    pub(crate) code: String,
    /// For people; never internal detail.
    pub(crate) message: String,
    /// The request field at fault (`input.model`, `id`, …).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) field: Option<String>,
}

/// An error answer: its code, a message for the caller, the field it is
/// about (when one is), and the headers some codes carry.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub(crate) code: Code,
    pub(crate) message: String,
    pub(crate) field: Option<String>,
    /// `Retry-After`, in seconds.
    pub(crate) retry_after: Option<u64>,
}

impl ApiError {
    pub(crate) fn new(code: Code, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
            field: None,
            retry_after: None,
        }
    }

    /// About `field` of the request.
    pub(crate) fn on(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    /// With `Retry-After: seconds`.
    pub(crate) fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// `503 unavailable` for a database error, which is logged, never sent.
    pub(crate) fn unavailable(e: impl std::fmt::Display) -> Self {
        tracing::error!(error = %e, "database error");
        ApiError::new(
            Code::Unavailable,
            "the database is unavailable; retry the request",
        )
    }

    /// What went wrong, as the body and a batch's item say it.
    pub(crate) fn detail(&self) -> ErrorDetail {
        ErrorDetail {
            code: self.code.as_str().to_owned(),
            message: self.message.clone(),
            field: self.field.clone(),
        }
    }

    /// The body: `{"error": {"code", "message", "field"?}}`.
    pub(crate) fn body(&self) -> ErrorBody {
        ErrorBody {
            error: self.detail(),
        }
    }
}

/// A field that is wrong: `422 invalid`, naming it.
impl From<crate::error::InvalidInput> for ApiError {
    fn from(e: crate::error::InvalidInput) -> Self {
        ApiError::new(Code::Invalid, e.to_string()).on(e.field)
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.message)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.code.status()
    }

    fn error_response(&self) -> HttpResponse {
        let mut r = HttpResponse::build(self.code.status());
        if self.code == Code::Unauthorized {
            r.insert_header((actix_web::http::header::WWW_AUTHENTICATE, "Bearer"));
        }
        if let Some(seconds) = self.retry_after {
            r.insert_header((actix_web::http::header::RETRY_AFTER, seconds.to_string()));
        }
        r.json(self.body())
    }
}

impl From<ApiError> for HttpResponse {
    fn from(e: ApiError) -> Self {
        e.error_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn each_code_answers_with_its_status_and_its_name() {
        let e = ApiError::new(Code::Invalid, "must be a string").on("id");
        assert_eq!(
            e.error_response().status(),
            StatusCode::UNPROCESSABLE_ENTITY
        );
        assert_eq!(
            serde_json::to_value(e.body()).unwrap(),
            json!({ "error": { "code": "invalid", "message": "must be a string", "field": "id" } })
        );
        let r = ApiError::new(Code::Unauthorized, "no token").error_response();
        assert_eq!(r.headers().get("www-authenticate").unwrap(), "Bearer");
        let r = ApiError::new(Code::Draining, "later")
            .retry_after(2)
            .error_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers().get("retry-after").unwrap(), "2");
    }
}
