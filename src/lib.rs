pub mod cli;
pub mod engine;
pub mod store;
pub mod actors;
pub mod config;
pub mod platform;
pub mod web;
