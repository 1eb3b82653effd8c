//! `smolchat user …` and `smolchat invite`: account administration straight on the configured
//! database (safe while the server runs: SQLite serialises the writes).
//!
//! Passwords come from the terminal (asked twice, without echo) or, with `--password-stdin`,
//! from the first line of standard input; they are never taken as arguments (those show up in
//! `ps` and shell histories).

use std::io::{BufRead, IsTerminal};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use smolchat_service::audit::Audit;

use smolchat_auth::accounts;
use smolchat_service::config::Config;
use smolchat_store::{Store, UserRole};

/// Where the database is: the same flags as `serve`.
#[derive(Args, Debug, Clone, Default)]
pub struct DbArgs {
    /// A TOML configuration file (layered over config/default.toml), for database.url.
    #[arg(long, env = "SMOLCHAT_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// Database URL, e.g. sqlite://data/smolchat.db (default: database.url).
    #[arg(long, global = true)]
    pub database_url: Option<String>,
}

impl DbArgs {
    fn url(&self) -> Result<String> {
        Ok(match &self.database_url {
            Some(url) => url.clone(),
            None => Config::load(self.config.as_deref())?.database.url,
        })
    }
}

#[derive(Args, Debug)]
pub struct UserArgs {
    #[command(subcommand)]
    pub command: UserCommand,
    #[command(flatten)]
    pub db: DbArgs,
}

#[derive(Subcommand, Debug)]
pub enum UserCommand {
    /// Create an account.
    Add {
        name: String,
        /// Give it the admin role (it sees /admin after signing in).
        #[arg(long)]
        admin: bool,
        /// Read the password from the first line of standard input instead of the terminal.
        #[arg(long)]
        password_stdin: bool,
    },
    /// Set an account's password (signs out all its sessions).
    Passwd {
        name: String,
        #[arg(long)]
        password_stdin: bool,
        /// Instead: a new random password, printed once; the account must choose its own at
        /// its next sign-in (as "Reset password" on the admin page).
        #[arg(long, conflicts_with = "password_stdin")]
        reset: bool,
    },
    /// List the accounts: name, role, disabled, created, last seen.
    List,
    /// Disable an account: its sessions and API keys stop working at once.
    Disable { name: String },
    /// Enable a disabled account.
    Enable { name: String },
}

#[derive(Args, Debug)]
pub struct InviteArgs {
    /// Hours the code stays valid.
    #[arg(long, default_value_t = 72)]
    pub expires_h: u64,
    #[command(flatten)]
    pub db: DbArgs,
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// The new password: one line of stdin, or typed twice on the terminal.
fn read_password(from_stdin: bool) -> Result<String> {
    if from_stdin {
        let mut line = String::new();
        std::io::stdin()
            .lock()
            .read_line(&mut line)
            .context("reading the password from standard input")?;
        let password = line.trim_end_matches(['\n', '\r']).to_string();
        accounts::check_password(&password)?;
        return Ok(password);
    }
    if !std::io::stdin().is_terminal() {
        bail!("no terminal to ask the password on; pipe it in with --password-stdin");
    }
    let first = rpassword::prompt_password("New password: ").context("reading the password")?;
    accounts::check_password(&first)?;
    let second = rpassword::prompt_password("Again: ").context("reading the password")?;
    if first != second {
        bail!("the passwords differ; nothing changed");
    }
    Ok(first)
}

async fn user_named(store: &Store, name: &str) -> Result<smolchat_store::User> {
    store
        .user_by_name(name)
        .await?
        .with_context(|| format!("no account is called {name:?}"))
}

/// Who the audit log names for a command run on the server: `cli:` and the system user.
fn cli_actor() -> String {
    let who = std::env::var("SUDO_USER")
        .or_else(|_| std::env::var("USER"))
        .unwrap_or_else(|_| "unknown".into());
    format!("cli:{who}")
}

fn when(t: Option<chrono::DateTime<chrono::Utc>>) -> String {
    t.map_or_else(|| "-".into(), |t| t.format("%Y-%m-%d %H:%M:%S").to_string())
}

pub fn run(args: &UserArgs) -> Result<()> {
    let url = args.db.url()?;
    // Before the runtime: the prompt must not run on an async worker.
    let password = match &args.command {
        UserCommand::Passwd { reset: true, .. } => None,
        UserCommand::Add { password_stdin, .. } | UserCommand::Passwd { password_stdin, .. } => {
            Some(read_password(*password_stdin)?)
        }
        _ => None,
    };
    runtime()?.block_on(async {
        let store = Store::open_beside_server(&url)
            .await
            .with_context(|| format!("opening {url}"))?;
        let audit = Audit::new(store.clone());
        let actor = cli_actor();
        match &args.command {
            UserCommand::Add { name, admin, .. } => {
                let role = if *admin {
                    UserRole::Admin
                } else {
                    UserRole::User
                };
                let user =
                    accounts::add_user(&store, name, password.as_deref().unwrap_or(""), role)
                        .await?;
                println!("created {} ({}) {}", user.name, role.as_str(), user.id);
                let target = format!("user:{}", user.name);
                audit
                    .record(&actor, "admin.create_user", &target, None, role.as_str())
                    .await;
            }
            UserCommand::Passwd { name, reset, .. } => {
                let user = user_named(&store, name).await?;
                let target = format!("user:{}", user.name);
                if *reset {
                    let new = accounts::reset_password(&store, &user).await?;
                    println!("{}", new.password);
                    eprintln!(
                        "password of {} reset (shown once, above); its sessions are signed out, \
                         its {} live API keys revoked, and it must choose a new one at its next \
                         sign-in",
                        user.name, new.keys_revoked
                    );
                    audit
                        .record(
                            &actor,
                            "admin.reset_password",
                            &target,
                            None,
                            "must change at next sign-in",
                        )
                        .await;
                } else {
                    accounts::set_password(&store, &user, password.as_deref().unwrap_or(""))
                        .await?;
                    println!(
                        "password of {} changed; its sessions are signed out",
                        user.name
                    );
                    audit
                        .record(&actor, "auth.password_changed", &target, None, "")
                        .await;
                }
            }
            UserCommand::List => {
                println!(
                    "{:<24} {:<6} {:<9} {:<20} {:<20}",
                    "NAME", "ROLE", "DISABLED", "CREATED", "LAST SEEN"
                );
                let mut offset = 0;
                loop {
                    let page = store.list_users(500, offset).await?;
                    for u in &page {
                        let u = &u.user;
                        println!(
                            "{:<24} {:<6} {:<9} {:<20} {:<20}",
                            u.name,
                            u.role.as_str(),
                            if u.is_disabled() { "yes" } else { "no" },
                            when(Some(u.created_at)),
                            when(u.last_seen_at)
                        );
                    }
                    if page.len() < 500 {
                        break;
                    }
                    offset += 500;
                }
            }
            UserCommand::Disable { name } | UserCommand::Enable { name } => {
                let disable = matches!(args.command, UserCommand::Disable { .. });
                let user = user_named(&store, name).await?;
                store.set_disabled(&user.id, disable).await?;
                let action = if disable {
                    "admin.disable_user"
                } else {
                    "admin.enable_user"
                };
                audit
                    .record(&actor, action, &format!("user:{}", user.name), None, "")
                    .await;
                println!(
                    "{} {}",
                    user.name,
                    if disable { "disabled" } else { "enabled" }
                );
            }
        }
        store.close().await;
        Ok(())
    })
}

pub fn invite(args: &InviteArgs) -> Result<()> {
    if args.expires_h == 0 {
        bail!("--expires-h must be at least 1");
    }
    let url = args.db.url()?;
    let hours = args.expires_h.min(24 * 365 * 10);
    runtime()?.block_on(async {
        let store = Store::open_beside_server(&url)
            .await
            .with_context(|| format!("opening {url}"))?;
        let code = accounts::create_invite(&store, Duration::from_secs(hours * 3600)).await?;
        Audit::new(store.clone())
            .record(
                &cli_actor(),
                "admin.create_invite",
                "",
                None,
                &format!("valid {hours} h"),
            )
            .await;
        store.close().await;
        println!("{code}");
        println!("/signup?invite={code}");
        eprintln!("valid for {hours} h, once");
        Ok(())
    })
}
