//! Black-box and engine integration tests, against a real PostgreSQL (a
//! throwaway server per test run, a fresh database per test) and real HTTP
//! servers on 127.0.0.1. One binary, one module per concern.

mod agent;
mod anthropic;
mod binary;
mod chaos;
mod children;
mod console;
mod cron;
mod dbfaults;
mod durability;
mod embedded;
mod explorer;
mod failover;
mod fairness;
mod fencing;
mod handoff;
mod intake;
mod journal;
mod library;
mod limits;
mod mcp;
mod operations;
mod parallel;
mod schedule;
mod security;
mod streams;
mod support;
mod telemetry;
mod tracing;
mod versions;
mod waits;
