//! [`sql`]: a hand-written statement with numbered placeholders (`$1`, `$2`,
//! …) whose prepared form is cached per connection.
//!
//! diesel's `sql_query` marks itself unsafe to cache, so every call is parsed
//! and planned again: one extra round trip and a fresh parse per statement,
//! which on a job's dozen statements was most of Postgres' CPU. A statement
//! here is cached under its text and bind types like any diesel DSL query.

use diesel::expression::{AsExpression, TypedExpressionType};
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{SqlType, Untyped};
use diesel::QueryResult;

type Bind<'a> = Box<dyn QueryFragment<Pg> + Send + Sync + 'a>;

/// A statement; bind `$n` with the n-th call to [`Sql::bind`].
#[must_use = "a statement does nothing until it is executed or loaded"]
pub struct Sql<'a> {
    text: &'static str,
    binds: Vec<Bind<'a>>,
}

/// Starts a statement.
pub fn sql<'a>(text: &'static str) -> Sql<'a> {
    Sql {
        text,
        binds: Vec::new(),
    }
}

impl<'a> Sql<'a> {
    /// Binds the next placeholder to `value` as SQL type `ST`.
    pub fn bind<ST, U>(mut self, value: U) -> Self
    where
        ST: SqlType + TypedExpressionType,
        U: AsExpression<ST>,
        U::Expression: QueryFragment<Pg> + Send + Sync + 'a,
    {
        self.binds.push(Box::new(value.as_expression()));
        self
    }
}

impl QueryFragment<Pg> for Sql<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        let mut rest = self.text;
        while let Some(pos) = rest.find('$') {
            let after = &rest[pos + 1..];
            let digits = after.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 {
                out.push_sql(&rest[..=pos]);
                rest = after;
                continue;
            }
            out.push_sql(&rest[..pos]);
            let n: usize = after[..digits].parse().expect("digits parse");
            let bind = n
                .checked_sub(1)
                .and_then(|i| self.binds.get(i))
                .ok_or_else(|| {
                    diesel::result::Error::QueryBuilderError(
                        format!("${n} has no bound value").into(),
                    )
                })?;
            bind.walk_ast(out.reborrow())?;
            rest = &after[digits..];
        }
        out.push_sql(rest);
        Ok(())
    }
}

impl QueryId for Sql<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl Query for Sql<'_> {
    type SqlType = Untyped;
}

#[cfg(test)]
mod tests {
    use super::*;
    use diesel::sql_types::{BigInt, Text};

    #[test]
    fn placeholders_become_binds_in_order_and_repeat() {
        let q = sql("SELECT $1, $2 WHERE x = $1 AND y = '$'")
            .bind::<Text, _>("a")
            .bind::<BigInt, _>(2i64);
        let text = diesel::debug_query::<Pg, _>(&q).to_string();
        assert!(
            text.starts_with("SELECT $1, $2 WHERE x = $3 AND y = '$'"),
            "{text}"
        );
        assert!(text.contains("binds: [\"a\", 2, \"a\"]"), "{text}");
    }
}
