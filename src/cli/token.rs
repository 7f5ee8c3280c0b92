//! `onceflow token create|list|set|revoke`: API tokens, managed against the
//! database directly (like `migrate`), never over the API.

use clap::{Args, Subcommand};

use super::config::DbArgs;

#[derive(Debug, Args)]
pub struct TokenArgs {
    #[command(flatten)]
    pub db: DbArgs,
    #[command(subcommand)]
    pub command: TokenCommand,
}

#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Create a token; it is printed once, alone on the last line (only its hash is kept).
    /// A token that is not admin also gets its own webhook signing secret,
    /// printed on the line before (`webhook-secret whsec_…`): its jobs'
    /// webhooks are signed with it, so give it to that tenant's consumer.
    Create {
        /// A name to know it by (1–100 of A-Z a-z 0-9 _ . : -); never reused.
        #[arg(long)]
        name: String,
        /// An operator token: sees and acts on every job.
        #[arg(long)]
        admin: bool,
        #[command(flatten)]
        share: ShareArgs,
    },
    /// Change how token NAME shares the nodes with other tenants.
    Set {
        /// The token's name.
        name: String,
        #[command(flatten)]
        share: ShareArgs,
    },
    /// List the tokens (names, never the tokens themselves).
    List,
    /// Revoke the token with this name: requests carrying it get 401.
    /// Revoking the last one does not reopen the API: without a live
    /// token every request is 401 until `open-development-mode`.
    Revoke {
        /// The token's name.
        name: String,
    },
    /// A token's own webhook signing secret.
    Secret {
        #[command(subcommand)]
        command: SecretCommand,
    },
    /// With no live token left, let a loopback server answer without a
    /// token again (development mode: anyone on this machine sees every
    /// job). Refused while a live token exists.
    OpenDevelopmentMode {
        /// Required: says you mean it.
        #[arg(long)]
        yes: bool,
    },
}

/// A token's share of the nodes.
#[derive(Debug, Args)]
pub struct ShareArgs {
    /// Its share of the nodes' turns when several tenants' jobs wait
    /// (1–1000, default 1): weights 3 and 1 start three of the first's
    /// jobs for one of the second's.
    #[arg(long)]
    weight: Option<i32>,
    /// The most jobs of one of its `concurrency_key`s that run at once,
    /// across every node (1–1000; default: the workflow's limit, or 1).
    #[arg(long)]
    key_concurrency: Option<i32>,
    /// Its budget of model tokens (input + output) per UTC day; a job
    /// whose token has spent it sends no model call until the next day.
    #[arg(long)]
    daily_token_budget: Option<i64>,
    /// What such a job does: wait for the next UTC day (default), or die
    /// `budget_exhausted`.
    #[arg(long, value_parser = ["wait", "die"])]
    on_budget_exhausted: Option<String>,
    /// At most STARTS jobs of one of its `concurrency_key`s start per
    /// PERIOD, across every node: `10/60s`, `100/1h` (1–1000 per 1s–1d).
    /// The rest wait (never a 429); a job's retries are not new starts.
    #[arg(long, value_name = "STARTS/PERIOD", value_parser = onceflow_engine::store::tokens::parse_throttle)]
    key_throttle: Option<(i32, i32)>,
    /// Removes a setting (`token set` only; repeatable): `key-concurrency`
    /// and `key-throttle` fall back to the workflow's (or none),
    /// `daily-token-budget` to no budget.
    #[arg(long, value_name = "SETTING",
          value_parser = ["key-concurrency", "daily-token-budget", "key-throttle"])]
    clear: Vec<String>,
}

impl ShareArgs {
    fn share(&self) -> onceflow_engine::store::tokens::Share {
        onceflow_engine::store::tokens::Share {
            weight: self.weight,
            key_concurrency: self.key_concurrency,
            daily_token_budget: self.daily_token_budget,
            budget_exhausted: match self.on_budget_exhausted.as_deref() {
                Some("die") => Some("die"),
                Some(_) => Some("wait"),
                None => None,
            },
            key_throttle: self.key_throttle,
            clear: onceflow_engine::store::tokens::Cleared {
                key_concurrency: self.clear.iter().any(|c| c == "key-concurrency"),
                daily_token_budget: self.clear.iter().any(|c| c == "daily-token-budget"),
                key_throttle: self.clear.iter().any(|c| c == "key-throttle"),
            },
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum SecretCommand {
    /// Print the signing secret(s) of token NAME (newest first).
    Show {
        /// The token's name.
        name: String,
    },
    /// Give token NAME a new signing secret; the previous one keeps signing
    /// beside it (two signatures per webhook) until the next rotation.
    Rotate {
        /// The token's name.
        name: String,
    },
}

pub fn run(args: TokenArgs) -> anyhow::Result<()> {
    let database = args.db.resolve()?;
    let result = actix_web::rt::System::new().block_on(async {
        let db = database.open(1).await?;
        let store = onceflow_engine::Store::new(db);
        match args.command {
            TokenCommand::Create { name, admin, share } => {
                create(&store, &name, admin, share.share()).await?
            }
            TokenCommand::List => list(&store).await?,
            TokenCommand::Set { name, share } => set(&store, &name, share.share()).await?,
            TokenCommand::Revoke { name } => {
                if store.tokens().revoke(&name).await? {
                    println!("revoked {name:?}");
                } else {
                    anyhow::bail!("no live token named {name:?}");
                }
            }
            TokenCommand::Secret {
                command: SecretCommand::Show { name },
            } => match store.tokens().secret(&name).await? {
                Some(secret) => println!("{secret}"),
                None => anyhow::bail!(
                    "token {name:?} has no secret of its own (an admin token, or one made before \
                     tokens had one: `onceflow token secret rotate {name}` gives it one); its jobs \
                     are signed with ONCEFLOW_WEBHOOK_SECRET"
                ),
            },
            TokenCommand::Secret {
                command: SecretCommand::Rotate { name },
            } => {
                let secret = store.tokens().rotate_secret(&name).await?;
                eprintln!(
                    "token {name:?} signs with a new secret (and the previous one, until the next \
                     rotation); nodes use it within 30 s:"
                );
                println!("{secret}");
            }
            TokenCommand::OpenDevelopmentMode { yes } => {
                if !yes {
                    anyhow::bail!(
                        "this lets a loopback server answer anyone on this machine without a \
                         token, and show them every job; pass --yes if you mean it"
                    );
                }
                let released = store.tokens().open_development_mode().await?;
                eprintln!(
                    "WARNING: DEVELOPMENT MODE reopened ({released} revoked token(s) released): \
                     with no live token, a server listening on loopback answers requests without \
                     a token and shows every job. `onceflow token create` closes it again."
                );
            }
        }
        anyhow::Ok(())
    });
    if let Some(pg) = database.embedded.as_ref().filter(|pg| pg.started_here()) {
        let _ = pg.stop();
    }
    result
}

type Share = onceflow_engine::store::tokens::Share;

/// `token create`: the token (shown once), its webhook secret, and the
/// warnings a first token or development-mode jobs call for.
async fn create(
    store: &onceflow_engine::Store,
    name: &str,
    admin: bool,
    share: Share,
) -> anyhow::Result<()> {
    if share.clear != Default::default() {
        anyhow::bail!("--clear is for `token set`: a new token has nothing to clear");
    }
    share.check()?;
    let first = !store.tokens().exist().await?;
    let token = store.tokens().create(name, admin).await?;
    if share != Default::default() {
        store.tokens().set_share(name, share).await?;
    }
    if first {
        eprintln!(
            "warning: this is the first token, so the API now requires one: every \
             request without it gets 401, /metrics included. Give the running \
             Prometheus scrape an admin token (`authorization: credentials: <token>`) \
             or it stops silently"
        );
    }
    let unowned = store.tokens().unowned_jobs().await?;
    if unowned > 0 && !admin {
        eprintln!(
            "warning: {unowned} jobs submitted in development mode belong to no \
             token: this token does not see them (an admin token sees every job)"
        );
    }
    if let Some(secret) = store.tokens().secret(name).await? {
        eprintln!(
            "its jobs' webhooks are signed with this secret of its own (Standard \
             Webhooks); give it to the consumer that receives them:"
        );
        println!("webhook-secret {secret}");
    }
    eprintln!(
        "created {} token {name:?}; it is shown once, below. Send it as \
         `Authorization: Bearer <token>` (the CLI reads ONCEFLOW_TOKEN).",
        if admin { "an admin" } else { "a" }
    );
    println!("{token}");
    Ok(())
}

/// `token list`: every token with its share of the nodes.
async fn list(store: &onceflow_engine::Store) -> anyhow::Result<()> {
    let tokens = store.tokens().list().await?;
    if tokens.is_empty() {
        println!("no tokens (the API answers without one on loopback only)");
    }
    for t in tokens {
        println!(
            "{:<30} {:<6} weight {:<4} key-concurrency {:<5} key-throttle {:<9} daily-tokens {:<12} created {}{}",
            t.name,
            if t.admin { "admin" } else { "" },
            t.weight,
            t.key_concurrency
                .map_or_else(|| "-".to_owned(), |k| k.to_string()),
            throttle_text(t.key_throttle, t.key_throttle_period_s, "-"),
            t.daily_token_budget.map_or_else(
                || "-".to_owned(),
                |b| format!("{b} ({})", t.budget_exhausted)
            ),
            t.created_at.format("%Y-%m-%d %H:%M:%S"),
            t.revoked_at
                .map(|r| format!(", revoked {}", r.format("%Y-%m-%d %H:%M:%S")))
                .unwrap_or_default()
        );
    }
    Ok(())
}

/// `token set`: changes a token's share, then shows it.
async fn set(store: &onceflow_engine::Store, name: &str, share: Share) -> anyhow::Result<()> {
    if share == Default::default() {
        anyhow::bail!(
            "nothing to change: give --weight, --key-concurrency, --key-throttle, \
             --daily-token-budget, --on-budget-exhausted or --clear"
        );
    }
    store.tokens().set_share(name, share).await?;
    let now = store
        .tokens()
        .list()
        .await?
        .into_iter()
        .find(|t| t.name == name)
        .ok_or_else(|| anyhow::anyhow!("no token named {name:?}"))?;
    println!(
        "token {name:?}: weight {}, key concurrency {}, key throttle {}, daily token budget {} (then {})",
        now.weight,
        now.key_concurrency
            .map_or_else(|| "the workflow's (or 1)".to_owned(), |k| k.to_string()),
        throttle_text(now.key_throttle, now.key_throttle_period_s, "the workflow's (or none)"),
        now.daily_token_budget
            .map_or_else(|| "none".to_owned(), |b| b.to_string()),
        now.budget_exhausted
    );
    Ok(())
}

/// A throttle as `token list` shows it: `10/60s`, or `none`.
fn throttle_text(starts: Option<i32>, period_s: Option<i32>, none: &str) -> String {
    match (starts, period_s) {
        (Some(n), Some(s)) => format!("{n}/{s}s"),
        _ => none.to_owned(),
    }
}
