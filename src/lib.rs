pub mod actors;
pub mod cli;
pub mod config;
pub mod engine;
pub mod platform;
pub mod secrets;
pub mod store;
pub mod web;
