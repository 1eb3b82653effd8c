// A real OpenID Connect provider (panva/oidc-provider) for smolchat's integration tests.
//
//   node tests/oidc/provider.mjs --port P --client-id ID --client-secret SECRET \
//       --redirect-uri URI [--redirect-uri URI2 ...] [--post-logout-redirect-uri URI ...] \
//       [--require-pkce]
//
// Listens on 127.0.0.1:P (P = 0 picks a free port); the issuer is http://127.0.0.1:<port> with no
// trailing slash. Prints exactly one line, `READY http://127.0.0.1:<port>`, on stdout once it
// listens; everything else goes to stderr. Runs until SIGTERM/SIGINT (exit 0).
//
// Test-only endpoints on the same port:
//   GET  /__test/health          -> 200 "ok"
//   GET  /__test/tamper          -> {"mode": "<current mode>"}
//   POST /__test/tamper {"mode"} -> alters the id_token of the NEXT successful token response
//                                   (one-shot); see README.md for the modes.
// See README.md for the accounts and the login form.

import * as http from 'node:http';
import * as crypto from 'node:crypto';

// oidc-provider prints its NOTICEs with console.info (stdout); stdout carries only the READY line.
console.log = console.error;
console.info = console.error;

const { default: Provider } = await import('oidc-provider');
const {
  generateKeyPair, exportJWK, decodeProtectedHeader, CompactSign,
} = await import('jose');

// ---------------------------------------------------------------------------------------------
// Command line

function usage(message) {
  if (message) process.stderr.write(`provider.mjs: ${message}\n`);
  process.stderr.write('usage: node tests/oidc/provider.mjs --port P --client-id ID --client-secret SECRET '
    + '--redirect-uri URI [--redirect-uri URI2 ...] [--post-logout-redirect-uri URI ...] [--require-pkce]\n');
  process.exit(2);
}

function parseArgs(argv) {
  const opts = {
    port: undefined,
    clientId: undefined,
    clientSecret: undefined,
    redirectUris: [],
    postLogoutRedirectUris: [],
    requirePkce: false,
  };
  for (let i = 0; i < argv.length; i += 1) {
    const arg = argv[i];
    let name = arg;
    let value;
    const eq = arg.indexOf('=');
    if (arg.startsWith('--') && eq !== -1) {
      name = arg.slice(0, eq);
      value = arg.slice(eq + 1);
    }
    const take = () => {
      if (value !== undefined) return value;
      i += 1;
      if (i >= argv.length) usage(`${name} needs a value`);
      return argv[i];
    };
    switch (name) {
      case '--port': opts.port = take(); break;
      case '--client-id': opts.clientId = take(); break;
      case '--client-secret': opts.clientSecret = take(); break;
      case '--redirect-uri': opts.redirectUris.push(take()); break;
      case '--post-logout-redirect-uri': opts.postLogoutRedirectUris.push(take()); break;
      case '--require-pkce': opts.requirePkce = true; break;
      case '-h': case '--help': usage(); break;
      default: usage(`unknown argument ${arg}`);
    }
  }
  if (opts.port === undefined || !/^\d+$/.test(opts.port) || Number(opts.port) > 65535) {
    usage('--port must be a number from 0 to 65535');
  }
  opts.port = Number(opts.port);
  if (!opts.clientId) usage('--client-id is required');
  if (!opts.clientSecret) usage('--client-secret is required');
  if (opts.redirectUris.length === 0) usage('at least one --redirect-uri is required');
  return opts;
}

const opts = parseArgs(process.argv.slice(2));

function log(...parts) {
  process.stderr.write(`oidc-test-provider: ${parts.join(' ')}\n`);
}

// ---------------------------------------------------------------------------------------------
// Accounts (password "pw" for each)

const PASSWORD = 'pw';
const ACCOUNTS = {
  alice: {
    sub: 'sub-alice', preferred_username: 'alice', name: 'Alice Admin', email: 'alice@example.com', groups: ['chat-admins', 'staff'],
  },
  bob: {
    sub: 'sub-bob', preferred_username: 'bob', name: 'Bob Staff', email: 'bob@example.com', groups: ['staff'],
  },
  mallory: {
    sub: 'sub-mallory', preferred_username: 'mallory', name: 'Mallory', email: 'mallory@evil.test', groups: [],
  },
};
const BY_SUB = new Map(Object.values(ACCOUNTS).map((a) => [a.sub, a]));

const SCOPES = ['openid', 'profile', 'email', 'groups'];
const CLAIMS = {
  openid: ['sub'],
  profile: ['preferred_username', 'name'],
  email: ['email', 'email_verified'],
  groups: ['groups'],
};
const ALL_CLAIMS = Object.values(CLAIMS).flat();

async function findAccount(ctx, sub) {
  const account = BY_SUB.get(sub);
  if (!account) return undefined;
  return {
    accountId: sub,
    // oidc-provider masks these by the granted scopes (and the claims parameter).
    async claims() {
      return {
        sub: account.sub,
        preferred_username: account.preferred_username,
        name: account.name,
        email: account.email,
        email_verified: true,
        groups: [...account.groups],
      };
    },
  };
}

// ---------------------------------------------------------------------------------------------
// Keys

const { privateKey: signingKey } = await generateKeyPair('RS256', { extractable: true });
const signingJwk = {
  ...(await exportJWK(signingKey)),
  kid: `test-${crypto.randomBytes(6).toString('hex')}`,
  alg: 'RS256',
  use: 'sig',
};

// ---------------------------------------------------------------------------------------------
// Pages

function esc(value) {
  return String(value)
    .replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;')
    .replace(/"/g, '&quot;').replace(/'/g, '&#39;');
}

function page(title, body) {
  return `<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>${esc(title)}</title>
</head>
<body>
${body}
</body>
</html>
`;
}

function loginPage(uid, { error, login } = {}) {
  return page('Sign in - test OpenID provider', `<h1>Sign in</h1>
${error ? `<p id="error" role="alert">${esc(error)}</p>` : ''}
<form method="post" action="/interaction/${esc(uid)}/login" autocomplete="off">
  <label for="login">User name</label>
  <input name="login" id="login" value="${esc(login || '')}" autofocus>
  <label for="password">Password</label>
  <input type="password" name="password" id="password">
  <button type="submit" id="signin">Sign in</button>
</form>`);
}

// RP-initiated logout: the confirmation form, with logout=yes added (end the whole session at this
// provider), submits itself; without JavaScript a "Sign out" button (id="logout") does the same.
async function logoutSource(ctx, form) {
  const withLogout = form.replace('</form>', '<input type="hidden" name="logout" value="yes"/></form>');
  ctx.type = 'html';
  ctx.body = page('Signing out - test OpenID provider', `<h1>Signing out</h1>
${withLogout}
<button type="submit" form="op.logoutForm" id="logout" name="logout" value="yes">Sign out</button>
<script>document.getElementById('op.logoutForm').submit();</script>`);
}

async function postLogoutSuccessSource(ctx) {
  ctx.type = 'html';
  ctx.body = page('Signed out - test OpenID provider', '<h1 id="signed-out">Signed out</h1>');
}

async function renderError(ctx, out) {
  ctx.type = 'html';
  ctx.body = page('Error - test OpenID provider', `<h1>Error</h1>
${Object.entries(out).map(([k, v]) => `<pre><strong>${esc(k)}</strong>: ${esc(v)}</pre>`).join('\n')}`);
}

// ---------------------------------------------------------------------------------------------
// Grants: consent is given automatically, for every scope and claim this provider knows.

async function grantEverything(ctx, grant) {
  grant.addOIDCScope(SCOPES.join(' '));
  grant.addOIDCClaims(ALL_CLAIMS);
  await grant.save();
  return grant;
}

async function loadExistingGrant(ctx) {
  const { Grant } = ctx.oidc.provider;
  const { clientId } = ctx.oidc.client;
  const { accountId } = ctx.oidc.account;
  const grantId = ctx.oidc.result?.consent?.grantId || ctx.oidc.session.grantIdFor(clientId);
  let grant = grantId ? await Grant.find(grantId) : undefined;
  if (grant && (grant.accountId !== accountId || grant.clientId !== clientId)) grant = undefined;
  if (!grant) grant = new Grant({ accountId, clientId });
  return grantEverything(ctx, grant);
}

// ---------------------------------------------------------------------------------------------
// Tamper control

const TAMPER_MODES = new Set(['none', 'forged_signature', 'expired', 'wrong_audience', 'wrong_nonce', 'wrong_issuer']);
let tamperMode = 'none';

function b64urlJson(part) {
  return JSON.parse(Buffer.from(part, 'base64url').toString('utf8'));
}

async function tamperIdToken(idToken, mode) {
  const parts = idToken.split('.');
  const header = decodeProtectedHeader(idToken);
  const payload = b64urlJson(parts[1]);
  const now = Math.floor(Date.now() / 1000);
  let key = signingKey;
  switch (mode) {
    case 'forged_signature':
      ({ privateKey: key } = await generateKeyPair('RS256', { extractable: true }));
      break;
    case 'expired':
      payload.iat = now - 7200;
      payload.exp = now - 3600;
      break;
    case 'wrong_audience':
      payload.aud = 'someone-else';
      break;
    case 'wrong_nonce':
      payload.nonce = 'not-the-nonce-you-sent';
      break;
    case 'wrong_issuer':
      payload.iss = 'http://evil.example';
      break;
    default:
      throw new Error(`unknown tamper mode ${mode}`);
  }
  // forged_signature keeps the exact payload bytes; the others re-serialise the changed claims.
  const bytes = mode === 'forged_signature'
    ? Buffer.from(parts[1], 'base64url')
    : Buffer.from(JSON.stringify(payload), 'utf8');
  return new CompactSign(bytes).setProtectedHeader(header).sign(key);
}

function readBody(ctx, limit = 65536) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    let size = 0;
    ctx.req.on('data', (chunk) => {
      size += chunk.length;
      if (size > limit) {
        reject(new Error('body too large'));
        ctx.req.destroy();
        return;
      }
      chunks.push(chunk);
    });
    ctx.req.on('end', () => resolve(Buffer.concat(chunks).toString('utf8')));
    ctx.req.on('error', reject);
  });
}

// ---------------------------------------------------------------------------------------------
// Server: listen first (port 0 = a free one), then make the provider with the real issuer.

let handler = (req, res) => {
  res.statusCode = 503;
  res.end('starting\n');
};
const server = http.createServer((req, res) => handler(req, res));
try {
  await new Promise((resolve, reject) => {
    server.once('error', reject);
    server.listen(opts.port, '127.0.0.1', resolve);
  });
} catch (err) {
  log(`cannot listen on 127.0.0.1:${opts.port}: ${err.message}`);
  process.exit(1);
}
const { port } = server.address();
const issuer = `http://127.0.0.1:${port}`;

const client = {
  client_id: opts.clientId,
  client_secret: opts.clientSecret,
  redirect_uris: opts.redirectUris,
  grant_types: ['authorization_code'],
  response_types: ['code'],
  // client_secret_post is accepted too: oidc-provider treats the two as interchangeable.
  token_endpoint_auth_method: 'client_secret_basic',
  id_token_signed_response_alg: 'RS256',
};
if (opts.postLogoutRedirectUris.length) {
  client.post_logout_redirect_uris = opts.postLogoutRedirectUris;
}

const provider = new Provider(issuer, {
  clients: [client],
  jwks: { keys: [signingJwk] },
  findAccount,
  scopes: SCOPES,
  claims: CLAIMS,
  conformIdTokenClaims: false,
  loadExistingGrant,
  responseTypes: ['code'],
  subjectTypes: ['public'],
  clientAuthMethods: ['client_secret_basic', 'client_secret_post'],
  pkce: {
    methods: ['S256'],
    required: () => opts.requirePkce,
  },
  cookies: { keys: [crypto.randomBytes(32).toString('hex')] },
  interactions: {
    url: (ctx, interaction) => `/interaction/${interaction.uid}`,
  },
  features: {
    devInteractions: { enabled: false },
    rpInitiatedLogout: { enabled: true, logoutSource, postLogoutSuccessSource },
    userinfo: { enabled: true },
  },
  renderError,
});

provider.on('server_error', (ctx, err) => log('server_error', err?.stack || err));
provider.on('grant.error', (ctx, err) => log('grant.error', err?.message, err?.error_description || ''));
provider.on('authorization.error', (ctx, err) => log('authorization.error', err?.message, err?.error_description || ''));
provider.on('end_session.error', (ctx, err) => log('end_session.error', err?.message, err?.error_description || ''));

const tokenPath = provider.pathFor('token');

// Token endpoint wrapper: the tamper mode applies to the next 200 response with an id_token.
provider.use(async (ctx, next) => {
  await next();
  if (ctx.path === tokenPath && ctx.method === 'POST' && ctx.status === 200
      && tamperMode !== 'none' && ctx.body && typeof ctx.body.id_token === 'string') {
    const mode = tamperMode;
    tamperMode = 'none';
    ctx.body = { ...ctx.body, id_token: await tamperIdToken(ctx.body.id_token, mode) };
    log(`tampered id_token: ${mode}`);
  }
});

// Test endpoints and the interaction (login) pages.
provider.use(async (ctx, next) => {
  if (ctx.path === '/__test/health' && ctx.method === 'GET') {
    ctx.type = 'text';
    ctx.body = 'ok';
    return undefined;
  }

  if (ctx.path === '/__test/tamper') {
    if (ctx.method === 'GET') {
      ctx.body = { mode: tamperMode };
      return undefined;
    }
    if (ctx.method === 'POST') {
      let mode;
      try {
        ({ mode } = JSON.parse(await readBody(ctx)));
      } catch (err) {
        ctx.status = 400;
        ctx.body = { error: 'body must be JSON {"mode": "..."}' };
        return undefined;
      }
      if (!TAMPER_MODES.has(mode)) {
        ctx.status = 400;
        ctx.body = { error: `unknown mode; one of ${[...TAMPER_MODES].join(', ')}` };
        return undefined;
      }
      tamperMode = mode;
      log(`tamper mode set: ${mode}`);
      ctx.body = { mode: tamperMode };
      return undefined;
    }
    ctx.status = 405;
    return undefined;
  }

  const match = /^\/interaction\/([^/]+)(\/login)?$/.exec(ctx.path);
  if (!match) return next();

  ctx.set('Cache-Control', 'no-store');
  let details;
  try {
    details = await provider.interactionDetails(ctx.req, ctx.res);
  } catch (err) {
    ctx.status = 400;
    ctx.type = 'html';
    ctx.body = page('Error - test OpenID provider', `<h1>Error</h1><p>${esc(err.message)}</p>`);
    return undefined;
  }
  const [, uid, login] = match;
  if (details.uid !== uid) {
    ctx.status = 400;
    ctx.type = 'text';
    ctx.body = 'interaction mismatch';
    return undefined;
  }

  const finish = async (result) => {
    const returnTo = await provider.interactionResult(ctx.req, ctx.res, result, { mergeWithLastSubmission: false });
    ctx.status = 303;
    ctx.redirect(returnTo);
  };

  if (details.prompt.name === 'consent') {
    // Not normally reached (loadExistingGrant grants everything), but consent is automatic anyway.
    const { Grant } = provider;
    const grant = details.grantId
      ? await Grant.find(details.grantId)
      : new Grant({ accountId: details.session.accountId, clientId: details.params.client_id });
    await grantEverything(ctx, grant);
    await finish({ consent: { grantId: grant.jti } });
    return undefined;
  }

  if (details.prompt.name !== 'login') {
    ctx.status = 400;
    ctx.type = 'text';
    ctx.body = `unsupported prompt ${details.prompt.name}`;
    return undefined;
  }

  if (!login) {
    if (ctx.method !== 'GET') {
      ctx.status = 405;
      return undefined;
    }
    ctx.type = 'html';
    ctx.body = loginPage(uid);
    return undefined;
  }

  if (ctx.method !== 'POST') {
    ctx.status = 405;
    return undefined;
  }
  const form = new URLSearchParams(await readBody(ctx));
  const name = form.get('login') || '';
  const password = form.get('password') || '';
  const account = Object.hasOwn(ACCOUNTS, name) ? ACCOUNTS[name] : undefined;
  if (!account || password !== PASSWORD) {
    log(`login refused for ${JSON.stringify(name)}`);
    ctx.type = 'html';
    ctx.body = loginPage(uid, { error: 'Wrong user name or password', login: name });
    return undefined;
  }
  log(`login: ${name}`);
  await finish({ login: { accountId: account.sub } });
  return undefined;
});

handler = provider.callback();

function shutdown(signal) {
  log(`${signal}, exiting`);
  process.exit(0);
}
process.on('SIGTERM', () => shutdown('SIGTERM'));
process.on('SIGINT', () => shutdown('SIGINT'));

log(`issuer ${issuer}, client ${opts.clientId}, redirect_uris ${opts.redirectUris.join(' ')}`);
process.stdout.write(`READY ${issuer}\n`);
