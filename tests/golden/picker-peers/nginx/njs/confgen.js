// Rendered by confgen from topology peers: routing on the request body's `model`.
// nginx has read the whole body into memory before js_content runs (client_body_buffer_size
// equals client_max_body_size), so r.requestText is the complete prompt.
const TABLE = {"forbidden":{"error":{"code":"permission_denied","message":"This API key is not allowed to use this model.","type":"invalid_request_error"}},"json_types":["application/json","application/json; charset=utf-8","application/json;charset=utf-8","application/json; charset=UTF-8","application/json;charset=UTF-8"],"model_not_found":["The model '{model}' does not exist or is not served here.","invalid_request_error","model_not_found"],"name":"peers","pools":{"chat":{"balance":"random_two","fallback":"confgen_unavailable"}},"routes":[{"models":["llama-8b"],"pool":"chat"}]};
// The GET /v1/models answer, the same bytes Envoy answers with (null: not answered here).
const MODELS = "{\"data\":[{\"created\":0,\"id\":\"llama-8b\",\"object\":\"model\",\"owned_by\":\"confgen\"}],\"object\":\"list\"}";
// Where confgen-sidecar answers GET /v1/models from its health view (null: not asked).
const MODELS_URL = "http://127.0.0.1:9109/v1/models";

function reply(r, status, body) {
    r.headersOut['Content-Type'] = 'application/json';
    r.return(status, JSON.stringify(body));
}

// The body's `model`, read exactly as the Envoy target reads it (docs/targets.md): only
// with no Content-Type or one of TABLE.json_types (whole-value comparison); a string is a
// model name; a number or boolean is a name no route has ({other: its text}); null, a list,
// an object, a body that is not one JSON object: no model (undefined).
function modelOf(r) {
    const type = r.headersIn['Content-Type'];
    if (type !== undefined && type !== '' && TABLE.json_types.indexOf(type) < 0) {
        return undefined;
    }
    let body;
    try {
        body = JSON.parse(r.requestText || '');
    } catch (e) {
        return undefined;
    }
    if (body === null || typeof body !== 'object' || Array.isArray(body)) {
        return undefined;
    }
    const model = body.model;
    if (typeof model === 'string') {
        return model;
    }
    if (typeof model === 'number' || typeof model === 'boolean') {
        return {other: String(model)};
    }
    return undefined;
}

function headerMatches(r, h) {
    const value = r.headersIn[h.name];
    if (h.present !== undefined) {
        return (value !== undefined) === h.present;
    }
    if (value === undefined) {
        return false;
    }
    return h.exact !== undefined ? value === h.exact : value.startsWith(h.prefix);
}

function matches(r, route, model) {
    if (route.path_prefix !== undefined && !r.uri.startsWith(route.path_prefix)) {
        return false;
    }
    if (route.headers !== undefined && !route.headers.every((h) => headerMatches(r, h))) {
        return false;
    }
    if (route.models !== undefined && (typeof model !== 'string' || route.models.indexOf(model) < 0)) {
        return false;
    }
    if (route.no_model === true && model !== undefined) {
        return false;
    }
    return true;
}

// Routes are tried in the topology's order: explicit routes, per-model routes, default pool.
function route(r) {
    const model = modelOf(r);
    for (let i = 0; i < TABLE.routes.length; i++) {
        const candidate = TABLE.routes[i];
        if (!matches(r, candidate, model)) {
            continue;
        }
        if (candidate.clients !== undefined && candidate.clients.indexOf(r.variables.confgen_client) < 0) {
            reply(r, 403, TABLE.forbidden);
            return;
        }
        r.internalRedirect('@pool_' + candidate.pool);
        return;
    }
    const missing = TABLE.model_not_found;  // [message with {model}, type, code]
    const named = model === undefined ? '' : (typeof model === 'string' ? model : model.other);
    const message = missing[0].split('{model}').join(named);
    reply(r, 404, {error: {message: message, type: missing[1], code: missing[2]}});
}

// GET /v1/models: the sidecar's list (only models with healthy capacity now) when it
// answers within js_fetch_timeout, else the full list from the topology.
async function models(r) {
    if (r.method !== 'GET' || MODELS === null) {
        route(r);
        return;
    }
    let body = MODELS;
    if (MODELS_URL !== null) {
        try {
            const reply = await ngx.fetch(MODELS_URL, {max_response_body_size: 1048576});
            if (reply.status === 200) {
                body = await reply.text();
            }
        } catch (e) {
            // the sidecar is not running or did not answer in time: the full list
        }
    }
    r.headersOut['Content-Type'] = 'application/json';
    r.return(200, body);
}

function status(r) {
    r.headersOut['Content-Type'] = 'application/json';
    r.return(200, JSON.stringify({
        topology: TABLE.name,
        nginx: r.variables.nginx_version,
        njs: njs.version,
        pools: TABLE.pools,
    }));
}

export default {models, route, status};
